"""Tokenizers generated in code, of any vocabulary size, for models with random weights.

A random-weight model still needs a working tokenizer: the pipeline tokenizes every prompt and the
text encoder's embedding table must match its vocabulary. Nothing can be downloaded, so the
tokenizers are made here, deterministically, in the two families the pipelines use:

- CLIP (byte-level BPE): every byte is a symbol, so any prompt in any script tokenizes; merges of
  lowercase letters fill the vocabulary up to the requested size, laid out like the real one
  (bytes, word-final bytes, merges, then ``<|startoftext|>`` and ``<|endoftext|>`` last, so the
  end token has the highest id as CLIP's pooling expects).
- T5 / UMT5 (SentencePiece-style Unigram): ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, pieces, then
  the ``<extra_id_N>`` sentinels with ``<extra_id_0>`` last, as in T5. Characters outside the
  pieces become ``<unk>``, as they do in the real T5.

The pieces are not a real language model's vocabulary; only the sizes and the special tokens are.
"""

from __future__ import annotations

import itertools
import json
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diffusiond.pipelines.tiny import BOS, EOS, _byte_chars

WORD_END = "</w>"
# 256 byte symbols, the same 256 as word-final symbols, and the two specials.
CLIP_MIN_VOCAB = 256 * 2 + 2
T5_SPECIALS = ("<pad>", "</s>", "<unk>")


def _letter_ngrams(length: int) -> Iterator[str]:
    for letters in itertools.product(string.ascii_lowercase, repeat=length):
        yield "".join(letters)


def _clip_merges(count: int) -> list[tuple[str, str]]:
    """``count`` merges building lowercase letter n-grams, shortest first.

    Level n appends one letter to every (n-1)-gram, alone and word-final; a level only starts once
    the previous one is complete, so every merge's left side is already a token.
    """
    merges: list[tuple[str, str]] = []
    for length in itertools.count(1):
        for prefix in _letter_ngrams(length):
            for letter in string.ascii_lowercase:
                for right in (letter, letter + WORD_END):
                    if len(merges) == count:
                        return merges
                    merges.append((prefix, right))
    raise AssertionError("unreachable")


def clip_tokenizer(vocab_size: int = 49408, *, max_length: int = 77, pad_token: str = EOS) -> Any:
    """A ``CLIPTokenizer`` with exactly ``vocab_size`` tokens (CLIP's own is 49408)."""
    from transformers import CLIPTokenizer

    if vocab_size < CLIP_MIN_VOCAB:
        raise ValueError(f"a byte-level CLIP vocabulary needs at least {CLIP_MIN_VOCAB} tokens, not {vocab_size}")
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + WORD_END: len(chars) + i for i, c in enumerate(chars)})
    merges = _clip_merges(vocab_size - CLIP_MIN_VOCAB)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    # Files rather than constructor arguments: every transformers version reads vocab.json/merges.txt.
    with tempfile.TemporaryDirectory(prefix="diffusiond-clip-tok-") as tmp:
        folder = Path(tmp)
        (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        lines = ["#version: 0.2", *(f"{left} {right}" for left, right in merges)]
        (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        tokenizer = CLIPTokenizer.from_pretrained(str(folder), model_max_length=max_length, pad_token=pad_token)
    if len(tokenizer) != vocab_size:
        raise AssertionError(f"generated CLIP tokenizer has {len(tokenizer)} tokens, not {vocab_size}")
    return tokenizer


def _t5_pieces(count: int) -> list[str]:
    """``count`` distinct pieces: word-start marker, printable ASCII, then lowercase n-grams."""
    pieces = ["▁"]
    singles = string.ascii_letters + string.digits + string.punctuation
    candidates = itertools.chain(
        (p for c in singles for p in ("▁" + c, c)),
        (p for n in itertools.count(2) for g in _letter_ngrams(n) for p in ("▁" + g, g)),
    )
    pieces.extend(itertools.islice(candidates, max(0, count - 1)))
    return pieces[:count]


def t5_tokenizer(pieces: int = 32000, *, extra_ids: int = 100, max_length: int = 512) -> Any:
    """A T5-style tokenizer with ``pieces`` SentencePiece entries plus ``extra_ids`` sentinels.

    T5 v1.1 has 32000 + 100 = 32100 tokens (its embedding rows: 32128), UMT5 256000 + 300 =
    256300 (256384 rows). Returned as a ``PreTrainedTokenizerFast``, which every pipeline that
    types its tokenizer as a T5 tokenizer accepts, and which any transformers version reloads.
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import PreTrainedTokenizerFast

    if pieces < len(T5_SPECIALS) + 1:
        raise ValueError(f"a T5 vocabulary needs at least {len(T5_SPECIALS) + 1} pieces, not {pieces}")
    sentinels = [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]
    # Equal scores: the best segmentation is the one with the fewest pieces, i.e. longest matches.
    vocab = [(s, 0.0) for s in T5_SPECIALS]
    vocab += [(p, -10.0) for p in _t5_pieces(pieces - len(T5_SPECIALS))]
    vocab += [(s, 0.0) for s in sentinels]
    backend = Tokenizer(Unigram(vocab, unk_id=T5_SPECIALS.index("<unk>"), byte_fallback=False))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    backend.add_special_tokens([*T5_SPECIALS, *sentinels])  # already in the vocabulary: ids do not move
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
        padding_side="right",
    )
    if len(tokenizer) != pieces + extra_ids:
        raise AssertionError(f"generated T5 tokenizer has {len(tokenizer)} tokens, not {pieces + extra_ids}")
    return tokenizer


# Qwen2's special tokens after its 151,643 byte-level BPE tokens, in their order: <|endoftext|> is
# 151643 and <|im_start|>/<|im_end|> follow, as the chat template Qwen-Image prompts with expects.
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip


def _letter_merges(count: int) -> list[tuple[str, str]]:
    """``count`` merges building lowercase letter n-grams, shortest first (no word-final forms)."""
    merges: list[tuple[str, str]] = []
    for length in itertools.count(1):
        for prefix in _letter_ngrams(length):
            for letter in string.ascii_lowercase:
                if len(merges) == count:
                    return merges
                merges.append((prefix, letter))
    raise AssertionError("unreachable")


def qwen_tokenizer(vocab_size: int = 151665, *, max_length: int = 32768) -> Any:
    """A ``Qwen2Tokenizer`` (byte-level BPE) with exactly ``vocab_size`` tokens, the specials included
    (Qwen2.5's own has 151,643 + 22 = 151,665; its embedding table has 152,064 rows)."""
    from transformers import Qwen2Tokenizer

    base = 256 + len(QWEN_SPECIALS)
    if vocab_size < base:
        raise ValueError(f"a byte-level Qwen vocabulary needs at least {base} tokens, not {vocab_size}")
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    merges = _letter_merges(vocab_size - base)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    specials = {token: len(vocab) + i for i, token in enumerate(QWEN_SPECIALS)}
    with tempfile.TemporaryDirectory(prefix="diffusiond-qwen-tok-") as tmp:
        folder = Path(tmp)
        (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        lines = ["#version: 0.2", *(f"{left} {right}" for left, right in merges)]
        (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        tokenizer = Qwen2Tokenizer.from_pretrained(str(folder), model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in QWEN_SPECIALS if t != "<|endoftext|>"]})
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    if len(tokenizer) != vocab_size or got != specials:
        raise AssertionError(f"generated Qwen tokenizer has {len(tokenizer)} tokens, not {vocab_size}, or moved ids")
    return tokenizer
