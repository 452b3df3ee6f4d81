/* fucina.text.tokenizer._merge: the per-piece merge loops of byte-level BPE and
 * SentencePiece, in C++ (the Python twins are fucina/text/tokenizer/{bpe,spm,merge}.py).
 *
 * Bpe(byte_chars, merges, token_to_id, n_vocab, ignore_merges) interns every symbol a
 * merge can produce once, at load (a symbol's id is its token id when its text is a
 * token): pair (left id, right id) -> (rank, merged id) in an open-addressing table,
 * plus llama.cpp's ASCII fallback for merge results that are no token.
 * Spm(token_to_id, scores, byte_ids) keeps token text -> (id, f32 score). Both have
 * encode_many(list | tuple of pieces) -> [tuple | None]: a str (or, for Spm, bytes)
 * piece -> its token ids, an int -> (int,), anything the native code declines (another
 * type, a byte with no token) -> None, left to the Python path.
 *
 * Merge order is llama.cpp's: best pair first (lowest rank / highest score), leftmost on
 * a tie; short pieces by list scans, eight in lockstep so that their table misses
 * overlap, long ones by a heap with stale-entry checks. Every argument is type- and
 * range-checked before any pointer is used; the tables are immutable after construction.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <queue>
#include <string>
#include <vector>

namespace {

constexpr Py_ssize_t LIST_MAX = 64;   // pieces up to this many symbols merge by list scans
constexpr int32_t NO_RANK = INT32_MAX;

uint64_t hash_bytes(const char *p, size_t n) {   // FNV-1a, then a final mix
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 1099511628211ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 32);
}

uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* byte string -> (int32 value, float payload), open addressing. A slot holds the first
 * 8 bytes of its key, so a lookup of a key up to 8 bytes long never leaves the slot, and
 * longer ones read the arena only on a likely hit. Lookups take a precomputed hash so
 * that callers can prefetch a batch of slots first: on a shared machine the table is
 * rarely in cache, and overlapping those misses is most of the speed. */
class StrTable {
  public:
    struct Slot { uint64_t head; uint32_t len, off; int32_t val; float aux; };   // val < 0: empty

    static uint64_t hash(const char *p, size_t n) { return hash_bytes(p, n); }
    static uint64_t head(const char *p, size_t n) {
        uint64_t h = 0;
        memcpy(&h, p, n < 8 ? n : 8);
        return h;
    }
    void reserve(size_t n) {
        size_t cap = 16;
        while (cap < 2 * n) cap <<= 1;
        rehash(cap);
    }
    void prefetch(uint64_t h) const {
        if (!slots_.empty()) __builtin_prefetch(&slots_[h & mask_]);
    }
    const Slot *find(const char *p, size_t n, uint64_t h) const {
        if (slots_.empty()) return nullptr;
        uint64_t hd = head(p, n);
        for (size_t i = h & mask_;; i = (i + 1) & mask_) {
            const Slot &s = slots_[i];
            if (s.val < 0) return nullptr;
            if (s.len == n && s.head == hd && (n <= 8 || !memcmp(arena_.data() + s.off, p + 8, n - 8)))
                return &s;
        }
    }
    int32_t find(const char *p, size_t n) const {
        const Slot *s = find(p, n, hash(p, n));
        return s ? s->val : -1;
    }
    /* the value stored for p (inserting val first when absent); overwrite replaces it.
     * False when the arena would pass 4 GiB. */
    bool insert(const char *p, size_t n, int32_t val, float aux, bool overwrite, int32_t &got) {
        return insert(p, n, hash(p, n), val, aux, overwrite, got);
    }
    bool insert(const char *p, size_t n, uint64_t h, int32_t val, float aux, bool overwrite, int32_t &got) {
        if (n > UINT32_MAX || arena_.size() + n > UINT32_MAX) return false;
        if (slots_.empty() || 2 * (count_ + 1) > slots_.size()) rehash(slots_.empty() ? 16 : 2 * slots_.size());
        const Slot *s = find(p, n, h);
        if (s) {
            Slot &w = const_cast<Slot &>(*s);
            if (overwrite) { w.val = val; w.aux = aux; }
            got = w.val;
            return true;
        }
        size_t i = h & mask_;
        while (slots_[i].val >= 0) i = (i + 1) & mask_;
        slots_[i] = Slot{head(p, n), (uint32_t)n, (uint32_t)arena_.size(), val, aux};
        if (n > 8) arena_.append(p + 8, n - 8);
        count_++;
        got = val;
        return true;
    }
    size_t size() const { return count_; }

  private:
    void rehash(size_t cap) {
        std::vector<Slot> old;
        old.swap(slots_);
        slots_.assign(cap, Slot{0, 0, 0, -1, 0.0f});
        mask_ = cap - 1;
        for (const Slot &s : old) {
            if (s.val < 0) continue;
            char key[8];
            memcpy(key, &s.head, 8);
            std::string full(key, s.len < 8 ? s.len : 8);
            if (s.len > 8) full.append(arena_, s.off, s.len - 8);
            size_t i = hash(full.data(), full.size()) & mask_;
            while (slots_[i].val >= 0) i = (i + 1) & mask_;
            slots_[i] = s;
        }
    }
    std::string arena_;   // the bytes of each key after its first 8
    std::vector<Slot> slots_;
    size_t mask_ = 0, count_ = 0;
};

/* (left id, right id) -> (rank, merged id), open addressing */
class PairTable {
  public:
    struct Slot { uint64_t key; int32_t rank; int32_t merged; };   // rank NO_RANK: empty

    void reserve(size_t n) {
        size_t cap = 16;
        while (cap < 2 * n) cap <<= 1;
        slots_.assign(cap, Slot{0, NO_RANK, -1});
        mask_ = cap - 1;
    }
    static uint64_t key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }
    void prefetch(int32_t a, int32_t b) const { __builtin_prefetch(&slots_[mix64(key(a, b)) & mask_]); }
    /* keeps the first rank given for a pair (llama.cpp's emplace); reserve() first */
    void insert(int32_t a, int32_t b, int32_t rank, int32_t merged) {
        uint64_t k = key(a, b);
        for (size_t i = mix64(k) & mask_;; i = (i + 1) & mask_) {
            Slot &s = slots_[i];
            if (s.rank == NO_RANK) { s = Slot{k, rank, merged}; return; }
            if (s.key == k) return;
        }
    }
    const Slot *find(int32_t a, int32_t b) const {
        uint64_t k = key(a, b);
        for (size_t i = mix64(k) & mask_;; i = (i + 1) & mask_) {
            const Slot &s = slots_[i];
            if (s.rank == NO_RANK) return nullptr;
            if (s.key == k) return &s;
        }
    }

  private:
    std::vector<Slot> slots_;
    size_t mask_ = 0;
};

/* UTF-8 of a str, lone surrogates passed through (Python's "surrogatepass"), as the
 * Python path encodes; written here to spare an allocation per string. False (no
 * exception pending) when it is not a str. */
bool utf8_of(PyObject *s, std::string &out) {
    if (!PyUnicode_Check(s)) return false;
    if (PyUnicode_READY(s) < 0) { PyErr_Clear(); return false; }
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    const void *data = PyUnicode_DATA(s);
    if (PyUnicode_IS_ASCII(s)) {
        out.assign((const char *)data, (size_t)n);
        return true;
    }
    int kind = PyUnicode_KIND(s);
    out.clear();
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < 0x80) {
            out.push_back((char)c);
        } else if (c < 0x800) {
            out.push_back((char)(0xC0 | (c >> 6)));
            out.push_back((char)(0x80 | (c & 0x3F)));
        } else if (c < 0x10000) {
            out.push_back((char)(0xE0 | (c >> 12)));
            out.push_back((char)(0x80 | ((c >> 6) & 0x3F)));
            out.push_back((char)(0x80 | (c & 0x3F)));
        } else {
            out.push_back((char)(0xF0 | (c >> 18)));
            out.push_back((char)(0x80 | ((c >> 12) & 0x3F)));
            out.push_back((char)(0x80 | ((c >> 6) & 0x3F)));
            out.push_back((char)(0x80 | (c & 0x3F)));
        }
    }
    return true;
}

/* the bytes of a str or bytes piece, without copying when the object holds them */
bool piece_bytes(PyObject *o, bool allow_bytes, std::string &scratch, const char *&p, size_t &n) {
    if (PyUnicode_Check(o) && PyUnicode_READY(o) == 0 && PyUnicode_IS_ASCII(o)) {
        p = (const char *)PyUnicode_DATA(o);
        n = (size_t)PyUnicode_GET_LENGTH(o);
        return true;
    }
    if (allow_bytes && PyBytes_Check(o)) {
        p = PyBytes_AS_STRING(o);
        n = (size_t)PyBytes_GET_SIZE(o);
        return true;
    }
    if (!utf8_of(o, scratch)) return false;
    p = scratch.data();
    n = scratch.size();
    return true;
}

/* The int objects of token_to_id's values, by id: result tuples share them as the Python
 * path's do (fewer objects; a warm encode touches less memory). Others are made. */
class IdObjects {
  public:
    ~IdObjects() {
        for (PyObject *o : objs_) Py_XDECREF(o);
    }
    void resize(size_t n) { objs_.assign(n, nullptr); }
    void keep(long id, PyObject *v) {   // id in range, checked by the caller
        if (!objs_[id] && PyLong_CheckExact(v)) {
            Py_INCREF(v);
            objs_[id] = v;
        }
    }
    PyObject *get(int32_t id) const {
        PyObject *o = id >= 0 && (size_t)id < objs_.size() ? objs_[id] : nullptr;
        if (!o) return PyLong_FromLong(id);
        Py_INCREF(o);
        return o;
    }

  private:
    std::vector<PyObject *> objs_;
};

/* token_to_id (str -> int) into a StrTable; every id must be in [0, limit); aux, when
 * given, is the payload per id */
bool load_tokens(PyObject *t2i, StrTable &tab, long limit, const std::vector<float> *aux, IdObjects &objs) {
    if (!PyDict_Check(t2i)) {
        PyErr_SetString(PyExc_TypeError, "token_to_id must be a dict");
        return false;
    }
    tab.reserve((size_t)PyDict_GET_SIZE(t2i));
    objs.resize((size_t)limit);
    // in blocks: encode and prefetch a block's slots, then insert (the misses overlap)
    constexpr int BLOCK = 32;
    std::string key[BLOCK];
    uint64_t hash[BLOCK];
    int32_t ids[BLOCK];
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    for (bool more = true; more;) {
        int nb = 0;
        while (nb < BLOCK && (more = PyDict_Next(t2i, &pos, &k, &v))) {
            if (!PyLong_Check(v)) {
                PyErr_SetString(PyExc_TypeError, "token_to_id values must be int");
                return false;
            }
            long id = PyLong_AsLong(v);
            if (id == -1 && PyErr_Occurred()) return false;
            if (id < 0 || id >= limit) {
                PyErr_Format(PyExc_ValueError, "token id %ld out of range [0, %ld)", id, limit);
                return false;
            }
            if (!utf8_of(k, key[nb])) {
                PyErr_SetString(PyExc_TypeError, "token_to_id keys must be str");
                return false;
            }
            ids[nb] = (int32_t)id;
            objs.keep(id, v);
            tab.prefetch(hash[nb] = StrTable::hash(key[nb].data(), key[nb].size()));
            nb++;
        }
        for (int i = 0; i < nb; i++) {
            int32_t got;
            if (!tab.insert(key[i].data(), key[i].size(), hash[i], ids[i], aux ? (*aux)[ids[i]] : 0.0f, true, got)) {
                PyErr_SetString(PyExc_ValueError, "vocabulary text too large");
                return false;
            }
        }
    }
    return true;
}

PyObject *ids_tuple(const IdObjects &objs, const int32_t *ids, size_t n) {
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    if (!t) return nullptr;
    for (size_t i = 0; i < n; i++) {
        PyObject *x = objs.get(ids[i]);
        if (!x) { Py_DECREF(t); return nullptr; }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
    }
    return t;
}

/* encode_many's shared loop. A Work is one piece's list merge, advanced one round of
 * table lookups at a time, so that WINDOW pieces in flight overlap their cache misses
 * (the tables are megabytes; on a shared machine they are rarely in cache):
 *   bool start(const Self *, const uint8_t *p, size_t n)  false: too long for list scans
 *   bool step()     do the lookups prefetched last time, merge once, prefetch the next
 *                   ones; true when no pair is left to merge
 *   bool emit(std::vector<int32_t> &out)                   false declines the piece
 *   static bool whole(const Self *, p, n, out)             a long piece, in one go
 * Results land at their own index, so the order of completion does not matter. */
constexpr int WINDOW = 8;

template <class Self, class Work>
PyObject *encode_many(const Self *self, PyObject *arg, bool allow_bytes) {
    // a tuple of its own: nothing a garbage collection runs meanwhile can resize it
    PyObject *seq = PyList_Check(arg) || PyTuple_Check(arg) ? PySequence_Tuple(arg) : nullptr;
    if (!seq) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "encode_many takes a list or tuple of pieces");
        return nullptr;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject *res = PyList_New(n);   // items NULL until set; list_dealloc copes
    if (!res) { Py_DECREF(seq); return nullptr; }
    std::string scratch;
    std::vector<int32_t> ids;
    std::vector<Work> work(WINDOW);
    Py_ssize_t piece_of[WINDOW];
    std::fill(piece_of, piece_of + WINDOW, -1);
    int active = 0;
    auto put = [&](Py_ssize_t i, PyObject *r) {
        if (r) PyList_SET_ITEM(res, i, r);
        return r != nullptr;
    };
    auto done = [&](Py_ssize_t i, bool ok) {
        if (ok) return put(i, ids_tuple(*self->id_objs, ids.data(), ids.size()));
        Py_INCREF(Py_None);
        return put(i, Py_None);
    };
    Py_ssize_t next = 0;
    while (next < n || active) {
        for (int w = 0; w < WINDOW && next < n; w++) {   // fill the free places
            while (piece_of[w] < 0 && next < n) {
                Py_ssize_t i = next++;
                PyObject *o = PyTuple_GET_ITEM(seq, i);
                const char *p;
                size_t len;
                bool ok = true;
                if (PyLong_Check(o)) {
                    ok = put(i, PyTuple_Pack(1, o));
                } else if (!piece_bytes(o, allow_bytes, scratch, p, len) || len >= (size_t)INT32_MAX) {
                    ok = done(i, false);
                } else if (work[w].start(self, (const uint8_t *)p, len)) {
                    piece_of[w] = i;
                    active++;
                } else {
                    ids.clear();
                    ok = done(i, Work::whole(self, (const uint8_t *)p, len, ids));
                }
                if (!ok) goto fail;
            }
        }
        for (int w = 0; w < WINDOW; w++) {
            if (piece_of[w] < 0 || !work[w].step()) continue;
            ids.clear();
            if (!done(piece_of[w], work[w].emit(ids))) goto fail;
            piece_of[w] = -1;
            active--;
        }
    }
    Py_DECREF(seq);
    return res;
fail:
    Py_DECREF(res);
    Py_DECREF(seq);
    return nullptr;
}

/* the symbols of a long piece as a doubly linked list (the heap-driven merges) */
struct Chain {
    std::vector<int32_t> prv, nxt;
    explicit Chain(size_t n) : prv(n), nxt(n) {
        for (size_t i = 0; i < n; i++) {
            prv[i] = (int32_t)i - 1;
            nxt[i] = i + 1 < n ? (int32_t)i + 1 : -1;
        }
    }
    /* `right` joins `left`; returns the symbol now after left (-1: none) */
    int32_t join(int32_t left, int32_t right) {
        int32_t k = nxt[right];
        nxt[left] = k;
        if (k >= 0) prv[k] = left;
        return k;
    }
};

/* encode_many as a method: refuses an object whose __init__ never succeeded */
template <class Self, class Work, bool AllowBytes>
PyObject *encode_many_method(PyObject *o, PyObject *arg) {
    Self *self = (Self *)o;
    if (!self->ready) {
        PyErr_Format(PyExc_RuntimeError, "%s is not initialised", Py_TYPE(o)->tp_name);
        return nullptr;
    }
    try {
        return encode_many<Self, Work>(self, arg, AllowBytes);
    } catch (const std::bad_alloc &) {
        return PyErr_NoMemory();
    }
}

/* ================= byte-level BPE ================= */

/* A symbol's id is its token id when its text is a token, else n_vocab + k (a merge
 * result that is no token; its ids are llama.cpp's ASCII fallback, in `extra`). */
struct BpeObject {
    PyObject_HEAD
    PairTable *pairs;
    StrTable *tokens;                 // kept only for ignore_merges (whole-word lookup)
    std::vector<int32_t> *extra_off;  // symbol n_vocab + k -> [extra_off[k], extra_off[k+1])
    std::vector<int32_t> *extra_ids;
    std::string *byte_text;           // the 256 byte stand-ins, UTF-8, concatenated
    IdObjects *id_objs;
    uint32_t byte_off[257];
    int32_t byte_sym[256];
    int32_t n_vocab;
    int32_t n_symbols;
    int ignore_merges;
    int ready;                        // set once __init__ succeeded
};

bool bpe_build(BpeObject *self, PyObject *byte_chars, PyObject *merges, PyObject *t2i) {
    if (!PyList_Check(byte_chars) || PyList_GET_SIZE(byte_chars) != 256) {
        PyErr_SetString(PyExc_ValueError, "byte_chars must be a list of 256 str");
        return false;
    }
    if (!PyList_Check(merges)) {
        PyErr_SetString(PyExc_TypeError, "merges must be a list of str");
        return false;
    }
    Py_ssize_t n_merges = PyList_GET_SIZE(merges);
    if (n_merges >= NO_RANK) {
        PyErr_SetString(PyExc_ValueError, "too many merges");
        return false;
    }
    StrTable &tokens = *self->tokens;
    if (!load_tokens(t2i, tokens, self->n_vocab, nullptr, *self->id_objs)) return false;
    StrTable extra;                                    // text of a symbol that is no token
    std::vector<std::pair<uint32_t, uint32_t>> extra_span;
    std::string extra_text;
    bool ok = true;
    auto intern = [&](const char *p, size_t n, uint64_t h) -> int32_t {
        const StrTable::Slot *t = tokens.find(p, n, h);
        if (t) return t->val;
        int32_t k = (int32_t)extra_span.size(), got;
        if ((int64_t)self->n_vocab + k >= INT32_MAX || extra_text.size() + n > UINT32_MAX ||
            !extra.insert(p, n, k, 0.0f, false, got)) {
            ok = false;
            return -1;
        }
        if (got == k) {
            extra_span.emplace_back((uint32_t)extra_text.size(), (uint32_t)n);
            extra_text.append(p, n);
        }
        return self->n_vocab + got;
    };
    std::string s;
    self->byte_off[0] = 0;
    for (int b = 0; b < 256; b++) {
        if (!utf8_of(PyList_GET_ITEM(byte_chars, b), s) || s.empty()) {
            PyErr_SetString(PyExc_ValueError, "byte_chars must be a list of 256 non-empty str");
            return false;
        }
        self->byte_sym[b] = intern(s.data(), s.size(), StrTable::hash(s.data(), s.size()));
        for (int c = 0; c < b; c++)
            if (self->byte_sym[c] == self->byte_sym[b]) {
                PyErr_SetString(PyExc_ValueError, "byte_chars must be distinct");
                return false;
            }
        self->byte_text->append(s);
        self->byte_off[b + 1] = (uint32_t)self->byte_text->size();
    }
    self->pairs->reserve((size_t)n_merges);
    // Merges go in blocks, each in three passes (parse and prefetch the texts' slots; intern
    // and prefetch the pair's slot; insert in rank order) so that the table misses overlap.
    struct Pending { std::string lr; size_t sp; uint64_t h[3]; int32_t id[3]; bool ok; };
    constexpr Py_ssize_t BLOCK = 32;
    std::vector<Pending> pend(BLOCK);
    for (Py_ssize_t r0 = 0; r0 < n_merges && ok; r0 += BLOCK) {
        Py_ssize_t r1 = std::min(n_merges, r0 + BLOCK);
        for (Py_ssize_t r = r0; r < r1; r++) {
            // the Python path looks up left + " " + right with neither side holding a space
            // (symbols are byte stand-ins): only a merge with one inner space can match
            Pending &q = pend[r - r0];
            q.ok = utf8_of(PyList_GET_ITEM(merges, r), s);
            size_t sp = q.ok ? s.find(' ') : std::string::npos;
            q.ok = sp != std::string::npos && sp != 0 && sp + 1 != s.size() &&
                   s.find(' ', sp + 1) == std::string::npos;
            if (!q.ok) continue;
            q.lr.assign(s, 0, sp);
            q.lr.append(s, sp + 1, std::string::npos);
            q.sp = sp;
            const char *t = q.lr.data();
            q.h[0] = StrTable::hash(t, sp);
            q.h[1] = StrTable::hash(t + sp, q.lr.size() - sp);
            q.h[2] = StrTable::hash(t, q.lr.size());
            for (uint64_t h : q.h) tokens.prefetch(h);
        }
        for (Py_ssize_t r = r0; r < r1; r++) {
            Pending &q = pend[r - r0];
            if (!q.ok) continue;
            const char *t = q.lr.data();
            q.id[0] = intern(t, q.sp, q.h[0]);
            q.id[1] = intern(t + q.sp, q.lr.size() - q.sp, q.h[1]);
            q.id[2] = intern(t, q.lr.size(), q.h[2]);
            self->pairs->prefetch(q.id[0], q.id[1]);
        }
        for (Py_ssize_t r = r0; r < r1 && ok; r++) {
            Pending &q = pend[r - r0];
            if (q.ok) self->pairs->insert(q.id[0], q.id[1], (int32_t)r, q.id[2]);
        }
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "merge table too large");
        return false;
    }
    self->n_symbols = self->n_vocab + (int32_t)extra_span.size();
    // llama.cpp looks each byte of a symbol that is no token up as a one-byte token; only
    // ASCII can match, the rest is dropped
    for (auto &sp : extra_span) {
        self->extra_off->push_back((int32_t)self->extra_ids->size());
        const char *p = extra_text.data() + sp.first;
        for (uint32_t i = 0; i < sp.second; i++) {
            if ((uint8_t)p[i] >= 0x80) continue;
            int32_t id = tokens.find(p + i, 1);
            if (id >= 0) self->extra_ids->push_back(id);
        }
    }
    self->extra_off->push_back((int32_t)self->extra_ids->size());
    if (!self->ignore_merges) {
        delete self->tokens;
        self->tokens = nullptr;
    }
    return true;
}

/* the ids of the final symbols: a token's own id, else its ASCII fallback */
void bpe_emit(const BpeObject *self, const int32_t *syms, size_t m, std::vector<int32_t> &out) {
    const int32_t nv = self->n_vocab;
    const std::vector<int32_t> &off = *self->extra_off, &ids = *self->extra_ids;
    for (size_t i = 0; i < m; i++) {
        int32_t s = syms[i];
        if (s < nv) out.push_back(s);
        else out.insert(out.end(), ids.begin() + off[s - nv], ids.begin() + off[s - nv + 1]);
    }
}

/* ignore_merges: the word's whole text, byte stand-ins and all */
void bpe_word(const BpeObject *self, const uint8_t *p, size_t n, std::string &w) {
    w.clear();
    for (size_t i = 0; i < n; i++)
        w.append(*self->byte_text, self->byte_off[p[i]], self->byte_off[p[i] + 1] - self->byte_off[p[i]]);
}

struct BpeCand {
    int32_t rank, left, right, lsym, rsym, merged;
    bool operator<(const BpeCand &o) const {   // priority_queue pops the greatest: invert
        return rank != o.rank ? rank > o.rank : left > o.left;
    }
};

/* a word of up to LIST_MAX bytes: lowest rank first, leftmost on a tie, by list scans */
struct BpeWork {
    const BpeObject *self;
    const PairTable *pairs;
    size_t m, last;
    bool first;
    uint64_t word_hash;
    std::string word;
    int32_t syms[LIST_MAX], rank[LIST_MAX], merged[LIST_MAX];

    bool start(const BpeObject *s, const uint8_t *p, size_t n) {
        if ((Py_ssize_t)n > LIST_MAX) return false;
        self = s;
        pairs = s->pairs;
        m = n;
        first = true;
        for (size_t i = 0; i < n; i++) syms[i] = s->byte_sym[p[i]];
        if (s->ignore_merges) {
            bpe_word(s, p, n, word);
            s->tokens->prefetch(word_hash = StrTable::hash(word.data(), word.size()));
        }
        for (size_t i = 0; i + 1 < m; i++) pairs->prefetch(syms[i], syms[i + 1]);
        return true;
    }
    void look(size_t i) {
        const PairTable::Slot *s = pairs->find(syms[i], syms[i + 1]);
        rank[i] = s ? s->rank : NO_RANK;
        merged[i] = s ? s->merged : -1;
    }
    bool step() {
        if (first) {
            first = false;
            if (self->ignore_merges) {
                const StrTable::Slot *t = self->tokens->find(word.data(), word.size(), word_hash);
                if (t) {
                    syms[0] = t->val;
                    m = 1;
                    return true;
                }
            }
            for (size_t i = 0; i + 1 < m; i++) look(i);
        } else {
            if (last) look(last - 1);
            if (last + 1 < m) look(last);
        }
        if (m < 2) return true;
        size_t best = 0;
        for (size_t i = 1; i + 1 < m; i++)
            if (rank[i] < rank[best]) best = i;
        if (rank[best] == NO_RANK) return true;
        syms[best] = merged[best];
        for (size_t i = best + 1; i + 1 < m; i++) syms[i] = syms[i + 1];
        for (size_t i = best; i + 2 < m; i++) { rank[i] = rank[i + 1]; merged[i] = merged[i + 1]; }
        m--;
        last = best;
        if (best) pairs->prefetch(syms[best - 1], syms[best]);
        if (best + 1 < m) pairs->prefetch(syms[best], syms[best + 1]);
        return false;
    }
    bool emit(std::vector<int32_t> &out) {
        bpe_emit(self, syms, m, out);
        return true;
    }

    /* a longer word: the same order through a heap of candidate pairs */
    static bool whole(const BpeObject *self, const uint8_t *p, size_t n, std::vector<int32_t> &out) {
        const PairTable &pairs = *self->pairs;
        if (self->ignore_merges) {
            std::string w;
            bpe_word(self, p, n, w);
            int32_t id = self->tokens->find(w.data(), w.size());
            if (id >= 0) {
                out.push_back(id);
                return true;
            }
        }
        std::vector<int32_t> syms(n);
        for (size_t i = 0; i < n; i++) syms[i] = self->byte_sym[p[i]];
        Chain ch(n);
        std::priority_queue<BpeCand> heap;
        auto push = [&](int32_t a, int32_t b) {
            if (a < 0 || b < 0) return;
            const PairTable::Slot *s = pairs.find(syms[a], syms[b]);
            if (s) heap.push(BpeCand{s->rank, a, b, syms[a], syms[b], s->merged});
        };
        for (size_t i = 0; i + 1 < n; i++) push((int32_t)i, (int32_t)i + 1);
        while (!heap.empty()) {
            BpeCand c = heap.top();
            heap.pop();
            // stale when either side merged since
            if (syms[c.left] != c.lsym || syms[c.right] != c.rsym || ch.nxt[c.left] != c.right) continue;
            syms[c.left] = c.merged;
            syms[c.right] = -1;
            int32_t k = ch.join(c.left, c.right);
            push(ch.prv[c.left], c.left);
            push(c.left, k);
        }
        size_t m = 0;
        for (int32_t i = n ? 0 : -1; i >= 0; i = ch.nxt[i]) syms[m++] = syms[i];
        bpe_emit(self, syms.data(), m, out);
        return true;
    }
};

void Bpe_dealloc(PyObject *o) {
    BpeObject *self = (BpeObject *)o;
    delete self->pairs;
    delete self->tokens;
    delete self->extra_off;
    delete self->extra_ids;
    delete self->byte_text;
    delete self->id_objs;
    PyTypeObject *tp = Py_TYPE(o);
    tp->tp_free(o);
    Py_DECREF(tp);
}

int Bpe_init(PyObject *o, PyObject *args, PyObject *kw) {
    static const char *kwlist[] = {"byte_chars", "merges", "token_to_id", "n_vocab", "ignore_merges", nullptr};
    BpeObject *self = (BpeObject *)o;
    PyObject *byte_chars, *merges, *t2i;
    long n_vocab;
    int ignore = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOl|p", (char **)kwlist, &byte_chars, &merges, &t2i,
                                     &n_vocab, &ignore))
        return -1;
    if (self->pairs || self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Bpe is already initialised");
        return -1;
    }
    if (n_vocab < 0 || n_vocab >= INT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "n_vocab out of range");
        return -1;
    }
    try {
        self->pairs = new PairTable();
        self->tokens = new StrTable();
        self->extra_off = new std::vector<int32_t>();
        self->extra_ids = new std::vector<int32_t>();
        self->byte_text = new std::string();
        self->id_objs = new IdObjects();
        self->n_vocab = (int32_t)n_vocab;
        self->ignore_merges = ignore;
        if (!bpe_build(self, byte_chars, merges, t2i)) return -1;
    } catch (const std::bad_alloc &) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

PyObject *Bpe_n_symbols(PyObject *o, void *) { return PyLong_FromLong(((BpeObject *)o)->n_symbols); }

PyMethodDef Bpe_methods[] = {
    {"encode_many", encode_many_method<BpeObject, BpeWork, false>, METH_O,
     "encode_many(pieces) -> list: token-id tuple per str piece, (x,) per int x, None where declined"},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef Bpe_getset[] = {{"n_symbols", Bpe_n_symbols, nullptr, "token ids + merge results that are no token", nullptr},
                            {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyType_Slot Bpe_slots[] = {
    {Py_tp_doc, (void *)"Bpe(byte_chars, merges, token_to_id, n_vocab, ignore_merges=False): byte-level BPE merges"},
    {Py_tp_init, (void *)Bpe_init},
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_dealloc, (void *)Bpe_dealloc},
    {Py_tp_methods, Bpe_methods},
    {Py_tp_getset, Bpe_getset},
    {0, nullptr}};
PyType_Spec Bpe_spec = {"fucina.text.tokenizer._merge.Bpe", sizeof(BpeObject), 0, Py_TPFLAGS_DEFAULT, Bpe_slots};

/* ================= SentencePiece ================= */

struct SpmObject {
    PyObject_HEAD
    StrTable *tokens;               // token text -> (id, score)
    IdObjects *id_objs;
    int32_t byte_ids[256];          // <0xXX> (or ASCII / unk) per byte, -1: none
    int ready;                      // set once __init__ succeeded
};

inline size_t utf8_len(uint8_t lead) {
    static const uint8_t len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[lead >> 4];
}

struct SpmCand {
    float score;
    int32_t left, right, tok;
    uint32_t size;
    bool operator<(const SpmCand &o) const {   // best = highest score, then leftmost
        return score != o.score ? score < o.score : left > o.left;
    }
};

/* the ids of the final symbols: its token, else (a character that is no token) the
 * token of each byte; false when a byte has none (the Python path raises the error) */
bool spm_emit(const SpmObject *self, const uint8_t *p, const int32_t *start, const int32_t *len,
              const int32_t *id, size_t m, std::vector<int32_t> &out) {
    for (size_t i = 0; i < m; i++) {
        if (id[i] >= 0) {
            out.push_back(id[i]);
            continue;
        }
        for (int32_t k = 0; k < len[i]; k++) {
            int32_t b = self->byte_ids[p[start[i] + k]];
            if (b < 0) return false;
            out.push_back(b);
        }
    }
    return true;
}

/* a piece of up to LIST_MAX characters: the pair forming the best-scoring token first,
 * leftmost on a tie, by list scans. Characters are cut by the lead byte alone. */
struct SpmWork {
    const SpmObject *self;
    const StrTable *tok;
    size_t m, last;
    bool first;
    uint8_t buf[4 * LIST_MAX];
    int32_t start_[LIST_MAX], len[LIST_MAX], id[LIST_MAX], pair[LIST_MAX];
    float key[LIST_MAX];
    uint64_t hc[LIST_MAX], hp[LIST_MAX];   // hashes of the characters, of the pairs

    uint64_t hash_pair(size_t i) {
        uint64_t h = StrTable::hash((const char *)buf + start_[i], (size_t)(len[i] + len[i + 1]));
        tok->prefetch(h);
        return h;
    }
    void look(size_t i) {
        const StrTable::Slot *s = tok->find((const char *)buf + start_[i], (size_t)(len[i] + len[i + 1]), hp[i]);
        pair[i] = s ? s->val : -1;
        key[i] = s ? s->aux : 0.0f;
    }
    bool start(const SpmObject *s, const uint8_t *p, size_t n) {
        if (n > sizeof buf) return false;
        m = 0;
        for (size_t i = 0; i < n; m++) {
            if ((Py_ssize_t)m == LIST_MAX) return false;
            size_t k = std::min(utf8_len(p[i]), n - i);
            start_[m] = (int32_t)i;
            len[m] = (int32_t)k;
            i += k;
        }
        self = s;
        tok = s->tokens;
        first = true;
        memcpy(buf, p, n);
        for (size_t i = 0; i < m; i++) tok->prefetch(hc[i] = StrTable::hash((const char *)buf + start_[i], len[i]));
        for (size_t i = 0; i + 1 < m; i++) hp[i] = hash_pair(i);
        return true;
    }
    bool step() {
        if (first) {
            first = false;
            for (size_t i = 0; i < m; i++) {   // the characters' own tokens, for those never merged
                const StrTable::Slot *t = tok->find((const char *)buf + start_[i], len[i], hc[i]);
                id[i] = t ? t->val : -1;
            }
            for (size_t i = 0; i + 1 < m; i++) look(i);
        } else {
            if (last) look(last - 1);
            if (last + 1 < m) look(last);
        }
        size_t best = m;
        for (size_t i = 0; i + 1 < m; i++)
            if (pair[i] >= 0 && (best == m || key[i] > key[best])) best = i;
        if (best == m) return true;
        len[best] += len[best + 1];
        id[best] = pair[best];
        for (size_t i = best + 1; i + 1 < m; i++) { start_[i] = start_[i + 1]; len[i] = len[i + 1]; id[i] = id[i + 1]; }
        for (size_t i = best; i + 2 < m; i++) { key[i] = key[i + 1]; pair[i] = pair[i + 1]; hp[i] = hp[i + 1]; }
        m--;
        last = best;
        if (best) hp[best - 1] = hash_pair(best - 1);
        if (best + 1 < m) hp[best] = hash_pair(best);
        return false;
    }
    bool emit(std::vector<int32_t> &out) { return spm_emit(self, buf, start_, len, id, m, out); }

    /* a longer piece: the same order through a heap of candidate pairs */
    static bool whole(const SpmObject *self, const uint8_t *p, size_t n, std::vector<int32_t> &out) {
        const StrTable &tok = *self->tokens;
        const char *c = (const char *)p;
        std::vector<int32_t> start, len, id;
        for (size_t i = 0; i < n;) {
            size_t k = std::min(utf8_len(p[i]), n - i);
            start.push_back((int32_t)i);
            len.push_back((int32_t)k);
            id.push_back(tok.find(c + i, k));
            i += k;
        }
        size_t m = start.size();
        Chain ch(m);
        std::priority_queue<SpmCand> heap;
        auto push = [&](int32_t a, int32_t b) {
            if (a < 0 || b < 0) return;
            uint32_t size = (uint32_t)(len[a] + len[b]);
            const StrTable::Slot *s = tok.find(c + start[a], size, StrTable::hash(c + start[a], size));
            if (s) heap.push(SpmCand{s->aux, a, b, s->val, size});
        };
        for (size_t i = 0; i + 1 < m; i++) push((int32_t)i, (int32_t)i + 1);
        while (!heap.empty()) {
            SpmCand cd = heap.top();
            heap.pop();
            // stale when either side merged since (llama.cpp's length check)
            if (len[cd.left] == 0 || len[cd.right] == 0 || (uint32_t)(len[cd.left] + len[cd.right]) != cd.size)
                continue;
            len[cd.left] += len[cd.right];
            len[cd.right] = 0;
            id[cd.left] = cd.tok;
            int32_t k = ch.join(cd.left, cd.right);
            push(ch.prv[cd.left], cd.left);
            push(cd.left, k);
        }
        size_t j = 0;
        for (int32_t i = m ? 0 : -1; i >= 0; i = ch.nxt[i]) {
            start[j] = start[i];
            len[j] = len[i];
            id[j++] = id[i];
        }
        return spm_emit(self, p, start.data(), len.data(), id.data(), j, out);
    }
};

void Spm_dealloc(PyObject *o) {
    SpmObject *self = (SpmObject *)o;
    delete self->tokens;
    delete self->id_objs;
    PyTypeObject *tp = Py_TYPE(o);
    tp->tp_free(o);
    Py_DECREF(tp);
}

int Spm_init(PyObject *o, PyObject *args, PyObject *kw) {
    static const char *kwlist[] = {"token_to_id", "scores", "byte_ids", nullptr};
    SpmObject *self = (SpmObject *)o;
    PyObject *t2i, *scores, *byte_ids;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO", (char **)kwlist, &t2i, &scores, &byte_ids)) return -1;
    if (self->tokens || self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Spm is already initialised");
        return -1;
    }
    if (!PyList_Check(scores) || !PyList_Check(byte_ids) || PyList_GET_SIZE(byte_ids) != 256) {
        PyErr_SetString(PyExc_TypeError, "scores must be a list of float, byte_ids a list of 256 int");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(scores);
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "vocabulary too large");
        return -1;
    }
    try {
        // scores are kept as float: exact for GGUF's f32 scores; anything else (or NaN,
        // whose order the Python path does not define) is refused and stays in Python
        std::vector<float> sc((size_t)n);
        for (Py_ssize_t i = 0; i < n; i++) {
            double x = PyFloat_AsDouble(PyList_GET_ITEM(scores, i));
            if (x == -1.0 && PyErr_Occurred()) return -1;
            if (std::isnan(x) || (double)(float)x != x) {
                PyErr_SetString(PyExc_ValueError, "scores must be non-NaN float32 values");
                return -1;
            }
            sc[i] = (float)x;
        }
        for (int b = 0; b < 256; b++) {
            long id = PyLong_AsLong(PyList_GET_ITEM(byte_ids, b));
            if (id == -1 && PyErr_Occurred()) return -1;
            if (id < -1 || id >= (long)n) {
                PyErr_SetString(PyExc_ValueError, "byte id out of range");
                return -1;
            }
            self->byte_ids[b] = (int32_t)id;
        }
        self->tokens = new StrTable();
        self->id_objs = new IdObjects();
        if (!load_tokens(t2i, *self->tokens, (long)n, &sc, *self->id_objs)) return -1;
    } catch (const std::bad_alloc &) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

PyMethodDef Spm_methods[] = {
    {"encode_many", encode_many_method<SpmObject, SpmWork, true>, METH_O,
     "encode_many(pieces) -> list: token-id tuple per str/bytes piece, (x,) per int x, None where declined"},
    {nullptr, nullptr, 0, nullptr}};
PyType_Slot Spm_slots[] = {
    {Py_tp_doc, (void *)"Spm(token_to_id, scores, byte_ids): SentencePiece score-driven merges"},
    {Py_tp_init, (void *)Spm_init},
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_dealloc, (void *)Spm_dealloc},
    {Py_tp_methods, Spm_methods},
    {0, nullptr}};
PyType_Spec Spm_spec = {"fucina.text.tokenizer._merge.Spm", sizeof(SpmObject), 0, Py_TPFLAGS_DEFAULT, Spm_slots};

PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_merge", "fucina tokenizer merge loops (native)", -1,
                      nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__merge(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return nullptr;
    PyObject *bpe = PyType_FromSpec(&Bpe_spec);
    if (!bpe || PyModule_AddObject(m, "Bpe", bpe) < 0) {
        Py_XDECREF(bpe);
        Py_DECREF(m);
        return nullptr;
    }
    PyObject *spm = PyType_FromSpec(&Spm_spec);
    if (!spm || PyModule_AddObject(m, "Spm", spm) < 0) {
        Py_XDECREF(spm);
        Py_DECREF(m);
        return nullptr;
    }
    if (PyModule_AddIntConstant(m, "LIST_MAX", LIST_MAX) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
