"""The project's structured-output test schemas (every output must validate).

Each is bounded (maxLength on free strings, ranges on numbers) so a sampled small
model finishes within a short max_tokens: the test is that the grammar holds, not
that the model is patient.
"""
from __future__ import annotations

S = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "nested_object": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False},
        "city": S}, "required": ["person", "city"], "additionalProperties": False},
    "array_min_max": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
             "required": ["colour"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
              "required": ["version", "kind"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "format_date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                    "required": ["day"], "additionalProperties": False},
    "format_email": {"type": "object", "properties": {"email": {"type": "string", "format": "email",
                                                                "maxLength": 24}},
                     "required": ["email"], "additionalProperties": False},
    "format_uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                    "required": ["id"], "additionalProperties": False},
    "format_date_time": {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}},
                         "required": ["at"], "additionalProperties": False},
    "format_ipv4": {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                    "required": ["ip"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {
        "score": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["score", "year"], "additionalProperties": False},
    "number_range": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                                      "y": {"type": "number", "minimum": 0, "maximum": 100}},
                     "required": ["x", "y"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [S, {"type": "integer", "minimum": 0,
                                                                          "maximum": 999}]}},
               "required": ["value"], "additionalProperties": False},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"title": S, "subtitle": S, "pages": {
        "type": "integer", "minimum": 1, "maximum": 999}}, "required": ["title"], "additionalProperties": False},
    "additional_false": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                         "required": ["a", "b"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": S, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["name", "qty"], "additionalProperties": False}},
    "nested_arrays": {"type": "object", "properties": {"grid": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                "items": {"type": "array", "minItems": 2,
                                                                          "maxItems": 2, "items": {"enum": [0, 1]}}}},
                      "required": ["grid"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 3,
                                                                 "maxLength": 6, "pattern": "^[a-z]+$"}},
                       "required": ["word"], "additionalProperties": False},
    "top_level_enum": {"enum": ["yes", "no", 1, None]},
    "boolean_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    "type_union": {"type": "object", "properties": {"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}},
                   "required": ["v"], "additionalProperties": False},
}

REGEXES = [r"(yes|no)\.", r"[A-Z][a-z]{2,8} [0-9]{1,3}", r"#[0-9a-f]{6}", r"\d{3}-\d{4}"]
