"""What the tokenizers library's pre-tokenizers, normalizers and decoders give, each alone, on
texts (and token lists) chosen to reach every branch: the reference for
tests/data/pipeline_steps_test.cpp.

usage: python tests/interop/make_pipeline_steps_reference.py   (writes tests/data/pipeline/reference.json)

Each entry is one step's tokenizer.json config, as the library serialises it, and its outputs:
pre-tokenizers the pieces of pre_tokenize_str, normalizers normalize_str, decoders decode.
"""
import json
import os

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "data",
                    "pipeline")  # where reference.json goes

TEXTS = [
    "", " ", "Hello, world!", "  two  spaces\tand\ttabs\nnew\r\nlines  ", "It's 3.14 -- isn't it?!...",
    "e-mail: someone@example.com (work) [x] {y} <z> $5 + 2 = 7 ^_^ ~`|\\/\"",
    "caf\u00e9 na\u00efve \u00c9COLE stra\u00dfe", "combining e\u0301 and a\u0308", "\u65e5\u672c\u8a9e\u3001\u3053\u3093\u306b\u3061\u306f\u3002",
    "\u00bfQu\u00e9? \u00a1S\u00ed! \u00abguillemets\u00bb \u201cquotes\u201d \u2014 dash \u2026", "under_score snake_case __init__",
    "digits \u00b2 \u00bd \u2167 \u0661\u0662\u0663 123abc", "nbsp\u00a0here\u3000ideographic\u2009thin\u200bzero-width",
    "emoji \U0001f600\U0001f389! #hashtag @mention", "\u0391\u03a3\u039f\u03a3 \u0418\u0432\u0430\u043d \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
    "a|b|c||d", "tab\u000bvertical\u000cform\u0085next\u2028line",
]

PRE_TOKENIZERS = [
    pre_tokenizers.Punctuation(), pre_tokenizers.Punctuation(behavior="removed"),
    pre_tokenizers.Punctuation(behavior="merged_with_previous"), pre_tokenizers.Punctuation(behavior="merged_with_next"),
    pre_tokenizers.Punctuation(behavior="contiguous"),
    pre_tokenizers.Whitespace(), pre_tokenizers.WhitespaceSplit(), pre_tokenizers.BertPreTokenizer(),
    pre_tokenizers.CharDelimiterSplit("|"), pre_tokenizers.CharDelimiterSplit(" "),
    # Falcon's: punctuation apart, then GPT-2 byte level, then digits apart.
    pre_tokenizers.Sequence([pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False),
                             pre_tokenizers.Digits(individual_digits=False)]),
]

NORMALIZERS = [
    normalizers.Strip(), normalizers.Strip(left=True, right=False), normalizers.Strip(left=False, right=True),
    normalizers.NFD(), normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()]),
    normalizers.ByteLevel(),
]

TOKEN_LISTS = [
    [], ["hello</w>", "wor", "ld</w>"], ["a</w>", "</w>", "b"], ["Hello", "</w>world</w>"],
]

DECODERS = [decoders.BPEDecoder(), decoders.BPEDecoder(suffix="@@")]


def config_of(step):
    return json.loads(step.__getstate__() if isinstance(step.__getstate__(), str) else step.__getstate__().decode())


def main():
    reference = {"tokenizers_version": tokenizers.__version__, "texts": TEXTS, "pre_tokenizers": [],
                 "normalizers": [], "decoders": []}
    for step in PRE_TOKENIZERS:
        reference["pre_tokenizers"].append({"config": config_of(step),
                                            "pieces": [[piece for piece, _ in step.pre_tokenize_str(text)] for text in TEXTS]})
    for step in NORMALIZERS:
        reference["normalizers"].append({"config": config_of(step), "normalized": [step.normalize_str(text) for text in TEXTS]})
    for step in DECODERS:
        reference["decoders"].append({"config": config_of(step), "cases": [
            {"tokens": tokens, "decoded": step.decode(tokens)} for tokens in TOKEN_LISTS]})
    with open(os.path.join(HERE, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(reference, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
