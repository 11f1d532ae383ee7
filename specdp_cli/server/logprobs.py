"""Log-probabilities in OpenAI's two shapes: completions' (tokens, token_logprobs, top_logprobs, text_offset)
and chat's ({"content": [{token, logprob, bytes, top_logprobs}]}). Each entry is a rank's (the token's
log-probability, [(id, log-probability)] of the most likely tokens): the target's own distribution at that
position, also for tokens accepted from drafts, as vLLM reports them."""
from __future__ import annotations


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def completion_logprobs(tokenizer, tokens: list[int], entries: list, offset: int) -> dict:
    """`offset`: where the first token's text starts in the choice's text (after an echoed prompt)."""
    pieces = [_piece(tokenizer, t) for t in tokens]
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p)
    # as vLLM: a token's top_logprobs hold the chosen token too
    top = [{**{_piece(tokenizer, t): v for t, v in alts}, p: lp} for p, (lp, alts) in zip(pieces, entries)]
    return {"tokens": pieces, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer, tokens: list[int], entries: list) -> dict:
    def item(token: int, lp: float) -> dict:
        s = _piece(tokenizer, token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, v) for a, v in alts]}
                        for t, (lp, alts) in zip(tokens, entries)]}
