"""How often an MTP head's first draft is right on replies to prompts it was not trained on,
free of timing noise: the trunk answers each prompt greedily, then one pass of the head over
the reply scores every first draft (token x_q and the trunk's state at q - 1 -> the trunk's
greedy token after q) against what the trunk said.

    python benchmarks/mtp_accuracy.py MODEL.gguf HEAD.gguf [HEAD2.gguf ...] [--max-tokens 128]

The first two prompts are benchmarks/mtp.py's free-form workloads (story, explain); none of
the six is in `fucina mtp train`'s built-in prompt set. A first-draft accuracy a is roughly
the share of passes that gain a token, so free-form speed-ups need a well above 0.3.
"""
from __future__ import annotations

import argparse

import torch

import fucina
from fucina import kernels
from fucina.models.mtp import load_head

PROMPTS = (
    "Write a short story about a lighthouse keeper who befriends a seagull.",
    "Explain how a refrigerator keeps food cold, in a few paragraphs.",
    "Write a letter to a friend describing your summer holiday.",
    "What makes a good team leader? Answer in a few paragraphs.",
    "Describe how a bill becomes a law.",
    "Tell me a story about a girl who finds a key in the snow.",
)


def greedy_reply(llm, prompt: str, max_tokens: int) -> tuple[list[int], int]:
    ids = llm.tokenizer.encode(llm.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True),
                               add_special=False, parse_special=True)
    llm.generate(ids, max_tokens=max_tokens, temperature=0)
    return ids + list(llm.last.tokens), len(ids)


@torch.inference_mode()
def first_draft_hits(model, head, seq: list[int], n_prompt: int) -> torch.Tensor:
    hidden = model._hidden(model.init_cache(len(seq)), seq, 0)
    greedy = model.head(hidden).argmax(-1)                 # the trunk's token after each position
    hn = head.forward(head.init_cache(len(seq)), seq[1:-1], head.trunk_state(hidden.float())[:-2], 0)
    if head.draft_w is not None:
        drafts = head.draft_ids[(hn.float() @ head.draft_w.T).argmax(-1)]
    else:
        drafts = head.logits(hn).argmax(-1)
    first = n_prompt - 1                                   # entry reading the reply's first token
    return drafts[first:] == greedy[first + 1:-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("heads", nargs="+")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    kernels.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    llm = fucina.load(a.model)
    replies = [greedy_reply(llm, q, a.max_tokens) for q in PROMPTS]
    for path in a.heads:
        head = load_head(llm.model, path)
        hits = [first_draft_hits(llm.model, head, seq, n) for seq, n in replies]
        total = torch.cat(hits).float().mean()
        per = ", ".join(f"{h.float().mean():.2f}" for h in hits)
        print(f"{path}: first-draft accuracy {total:.3f} over {sum(h.numel() for h in hits)} reply tokens "
              f"(per prompt: {per})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
