"""A Gemma-layout tokenizer.json and the ids and decoded text the tokenizers library gives for
it: the reference for tests/data/gemma_tokenizer_test.cpp.

usage: python tests/interop/make_gemma_tokenizer_reference.py   (writes tests/data/gemma/)

Gemma's files (transformers' GemmaTokenizer) are sentencepiece-style BPE with byte_fallback and
fuse_unk, normalizer Replace(" " -> "▁"), pre-tokenizer Split(" ", merged_with_previous), which
finds no space left after the normalizer, so BPE merges all the text between two added tokens
at once; decoder Replace("▁" -> " ") + ByteFallback + Fuse; <bos> first. The vocabulary is the
small Brown one of tests/interop/make_sentencepiece_reference.py, plus two merges that the
trained pieces lack and Gemma's vocabulary has: "e" + "▁" (Gemma joins ">" to a following "▁"
in ">▁</") and "▁" + "▁" (runs of spaces), so that the test covers where the C++ BPE may cut
that long input into words. Deterministic: the same files on every run.
"""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "data", "gemma")  # where the files go
import make_sentencepiece_reference as sentencepiece  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

JOINING_MERGES = [["e", "▁"], ["▁", "▁"]]
GEMMA_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}


def gemma_model():
    model = sentencepiece.sentencepiece_layout(sentencepiece.train_pieces())
    for left, right in JOINING_MERGES:
        model["vocab"].setdefault(left + right, len(model["vocab"]))
    model["merges"] = JOINING_MERGES + [merge for merge in model["merges"] if merge not in JOINING_MERGES]
    return model


def gemma_document(model):
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [sentencepiece.added_token(id, content) for id, content in enumerate(sentencepiece.SPECIAL_TOKENS)],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": sentencepiece.bos_template(),
        "decoder": GEMMA_DECODER,
        "model": model,
    }


def main():
    with open(os.path.join(HERE, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(gemma_document(gemma_model()), f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(HERE, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
        f.write("\n")
    tokenizer = Tokenizer.from_file(os.path.join(HERE, "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(HERE, "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    # Whole held-out documents besides the edge cases: inputs of thousands of characters.
    sentencepiece.TEXTS = sentencepiece.TEXTS + [
        "the  end", "thee\u2581\u2581e", "one.\n\ntwo", "a>\u2581</b"] + sentencepiece.read_documents("val.jsonl", 3)
    with open(os.path.join(HERE, "reference.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizers_version": sentencepiece.tokenizers.__version__,
                   "cases": sentencepiece.encode_all(tokenizer, fast)}, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
