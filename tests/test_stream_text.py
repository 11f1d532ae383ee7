"""The frontend's streaming pieces without a server: incremental detokenization (the streamed text equals
the whole decode, for byte-level and SentencePiece-style tokenizers, however the tokens are chunked), the
rank link's frame parser (messages split anywhere in the byte stream) and a request's mailbox."""
import asyncio
import marshal
import os
import random
import struct
from multiprocessing import Pipe
from pathlib import Path

import pytest

from specdp_cli.modeldir import load_tokenizer
from specdp_cli.server.app import _next_event
from specdp_cli.server.frontend import Event, Inflight, IncrementalText, Mailbox, text_decoder
from specdp_cli.server.link import Frames, send_message

DEMO = Path(__file__).resolve().parent.parent / "demo" / "pair" / "target"
TEXTS = ["def héllo(x):\n    return x + 1  # naïve café", "中文字符 and emoji 🙂🙃 mixed\tin",
         "  leading spaces, stop here. ok", "a b c d e f g"]


def metaspace_tokenizer():
    """A small SentencePiece-style tokenizer (Metaspace: a token carries its leading space as '▁'), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_], show_progress=False)
    tok.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request):
    return load_tokenizer(str(DEMO)) if request.param == "byte-level" else metaspace_tokenizer()


def full(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chunks(ids, rng):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        whole = full(tokenizer, ids)
        parts = chunks(ids, rng)
        stream = IncrementalText(tokenizer, [])
        sent = "".join(stream.add(p) for p in parts[:-1])
        assert whole.startswith(sent)
        assert sent + stream.finish(parts[-1], None) == whole


def test_fast_tokenizers_decode_without_the_wrapper(tokenizer):
    """Both tokenizers are fast ones: the streams above went through the Rust decode directly, and gave the
    wrapper's text (`full`)."""
    assert text_decoder(tokenizer).__name__ == "fast"


def test_held_back_stop_string_and_its_cut(tokenizer):
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    n = next(n for n in range(len(ids) + 1) if "stop here" in full(tokenizer, ids[:n]))   # the rank stops here
    end = full(tokenizer, ids).index("stop here")
    stream = IncrementalText(tokenizer, ["stop here"])
    sent = ""
    for t in ids[:n - 1]:
        sent += stream.add([t])
        assert len(sent) <= end          # no part of what may become the stop string is sent
    assert sent + stream.finish(ids[n - 1:n], end) == full(tokenizer, ids)[:end]


def test_a_character_split_over_tokens_is_never_sent_half(tokenizer):
    ids = tokenizer.encode("🙂🙃", add_special_tokens=False)
    stream = IncrementalText(tokenizer, [])
    sent = "".join(stream.add([t]) for t in ids)
    assert "\ufffd" not in sent
    assert sent + stream.finish([], None) == "🙂🙃"


def test_frames_split_anywhere():
    a, b = Pipe()
    msgs = [("out", [("cmpl-1", [1, 2, 3], None, None, None, None)], {}, (1, 0, 0.5, 0, 0, 0)),
            ("out", [("x" * 40_000, list(range(5000)), "stop", 7, {"k": 1}, None)], {1: 3}, (0, 0, 0.0, 0, 2, 1)),
            ("bye", 0)]
    for m in msgs:
        send_message(a, m)
    a.close()
    raw = b""
    while chunk := os.read(b.fileno(), 1 << 20):
        raw += chunk
    rng = random.Random(0)
    for _ in range(20):
        frames, got, i = Frames(), [], 0
        while i < len(raw):
            n = rng.randint(1, 9000)
            got += frames.feed(raw[i:i + n])
            i += n
        assert got == msgs and not frames.buf
    # the 8-byte size a message over 2 GiB would have (built by hand: the parser's other branch)
    payload = marshal.dumps(("out", [], {}, None))
    big = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    assert Frames().feed(big[:7]) == [] and Frames().feed(big) == [("out", [], {}, None)]


def test_a_stream_takes_every_event_arrived_up_to_its_end():
    """A stream's next chunk: every event that has arrived, merged (tokens, log-probabilities) up to the first
    that ends the request; what came after stays for the next read; a reader waiting on an empty mailbox wakes
    on the next event."""
    async def scenario():
        inf = Inflight("r", None, 0, 0, Mailbox())
        for ev in (Event([1], logprobs=[(-0.1, [])]), Event([2, 3], logprobs=[(-0.2, []), (-0.3, [])]),
                   Event([4], "stop", 7, {"n": 1}, logprobs=[(-0.4, [])]), Event([], "disconnect")):
            inf.mailbox.put(ev)
        first = await _next_event(inf)
        assert (first.new_tokens, first.finish_reason, first.stop_text_end, first.stats) == ([1, 2, 3, 4], "stop", 7,
                                                                                            {"n": 1})
        assert [lp for lp, _ in first.logprobs] == [-0.1, -0.2, -0.3, -0.4]
        assert (await _next_event(inf)).finish_reason == "disconnect"
        reader = asyncio.ensure_future(_next_event(inf))
        await asyncio.sleep(0)                 # the reader now waits on the empty mailbox
        assert not reader.done()
        inf.mailbox.put(Event([5]))
        alone = await asyncio.wait_for(reader, 5)
        assert (alone.new_tokens, alone.finish_reason, alone.logprobs) == ([5], None, None)
    asyncio.run(scenario())
