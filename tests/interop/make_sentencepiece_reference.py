"""Sentencepiece-style tokenizer.json files (Llama 2, Mistral) and the ids and decoded text the
tokenizers library gives for them: the reference for tests/data/sentencepiece_tokenizer_test.cpp.

usage: python make_sentencepiece_reference.py [OUT_DIR]   (default: tests/data/sentencepiece)

Trains a small BPE on the Brown corpus and lays it out like a sentencepiece conversion: <unk>,
<s>, </s>, the 256 byte tokens <0x00>..<0xFF>, then the learned pieces ("▁the"), byte_fallback
and fuse_unk on. Writes
  llama2/   normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, decoder Replace +
            ByteFallback + Fuse + Strip, post-processor adding <s> (Llama 2's tokenizer.json)
  mistral/  no normalizer, pre-tokenizer Metaspace(prepend_scheme "first", split false),
            decoder Metaspace (the newer layout transformers writes with legacy=false)
  reference.json  for every variant (one of the two folders, plus an RFC 7386 merge patch on its
            tokenizer.json) and every text: ids, ids_no_special, and the decode of ids with
            skip_special_tokens false and true.
Deterministic: the same files on every run.
"""
import copy
import json
import os
import sys

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BROWN = os.path.join(ROOT, "..", "shared", "data", "brown")
TRAIN_DOCUMENTS = 100
VOCAB_SIZE = 1500  # pieces learned by BPE; the 256 byte tokens come on top
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def read_documents(name, count):
    with open(os.path.join(BROWN, name), encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(count), f)]


def train_pieces():
    """A BPE trained like sentencepiece: on lines (so "\\n" stays out of the vocab and falls back
    to <0x0A>), words cut at "▁" with "▁" in front."""
    lines = [line for text in read_documents("train.jsonl", TRAIN_DOCUMENTS) for line in text.split("\n") if line.strip()]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(lines, trainer)
    return json.loads(tokenizer.to_str())["model"]


def sentencepiece_layout(trained):
    """Ids as in Llama 2's file: specials 0..2, <0x00>..<0xFF> 3..258, then the learned pieces."""
    vocab = {token: id for id, token in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    return dict(trained, vocab=vocab, ignore_merges=False)


def added_token(id, content, special=True, normalized=False, lstrip=False, rstrip=False):
    return {"id": id, "content": content, "single_word": False, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def bos_template():
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}


LLAMA2_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def llama2_document(model):
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added_token(id, content) for id, content in enumerate(SPECIAL_TOKENS)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": bos_template(),
        "decoder": LLAMA2_DECODER,
        "model": model,
    }


def metaspace(prepend_scheme, split):
    return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend_scheme, "split": split}


def mistral_document(model):
    return dict(llama2_document(model), normalizer=None, pre_tokenizer=metaspace("first", False),
                decoder=metaspace("first", False))


# Variants beyond the two files, as merge patches: options the two files leave unexercised.
PATCHED_VARIANTS = {
    # Metaspace with Llama 2's decoder, as Mistral v0.3 and transformers' legacy=false files have.
    "mistral-llama2-decoder": ("mistral", {"decoder": LLAMA2_DECODER}),
    # Characters outside the vocab become <unk>, runs of them one <unk> (fuse_unk).
    "llama2-no-byte-fallback": ("llama2", {"model": {"byte_fallback": False}}),
    # Metaspace prepending to every section and splitting at "▁"; bytes decoded before Metaspace.
    "metaspace-always-split": ("mistral", {
        "pre_tokenizer": metaspace("always", True),
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, metaspace("always", True),
                                                      {"type": "Fuse"}]}}),
    # A regex Replace and NFC before Metaspace that never prepends; Strip of two leading spaces.
    "regex-replace-never": ("mistral", {
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}]},
        "pre_tokenizer": metaspace("never", True),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 2, "stop": 0}]}}),
    # Added tokens: a normalized one (matched and decoded in its normalized form "▁hello▁world"),
    # one with rstrip, a special one with lstrip.
    "llama2-added-tokens": ("llama2", {"added_tokens": [added_token(id, content) for id, content in
                                                        enumerate(SPECIAL_TOKENS)] + [
        added_token(VOCAB_SIZE + 256, "hello world", special=False, normalized=True),
        added_token(VOCAB_SIZE + 257, "[INST]", special=False, rstrip=True),
        added_token(VOCAB_SIZE + 258, "<pad>", lstrip=True)]}),
}


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (nlohmann's merge_patch in the C++ test)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def brown_sentences():
    """Two long sentences of held-out Brown text (not trained on)."""
    text = read_documents("val.jsonl", 2)
    return [text[0].split("\n")[0], text[1].split("\n")[3]]


TEXTS = [
    "", "a", " ", "  ", "\t", "\n",
    "Hello world", " Hello world", "Hello world ", "   three leading spaces", "trailing spaces   ",
    "multiple    spaces   inside", "line one\nline two", "\n\nleading newlines", "hello\r\nwindows",
    "tab\tseparated\tvalues", "caf\u00e9 na\u00efve r\u00e9sum\u00e9", "combining e\u0301 accent",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "mixed \u4e2d\u6587 and English",
    "emoji \U0001f600\U0001f389 party", "non\u00a0breaking space", "\u03a9\u2248\u00e7\u221a\u222b math \u00b1",
    "<s>", "<s>Hello", "Hello<s>world", "Hello </s> world", " <s> after a space", "<unk>", "</s></s>",
    "<s> [INST] What is the capital of France? [/INST] Paris.</s>", "</s>text after eos",
    "hello world", "say hello world, hello world!", "[INST]   spaced <pad> out",
    "The year 1961 had 365 days.", "3.14159 2,000,000 $45.50",
    "Punctuation!? (yes) [no] {maybe} \"quotes\" 'single'", "It's a dog's life, isn't it?",
    "e-mail: someone@example.com", "\u2581 a literal metaspace", "\u2581\u2581double", "<0x41> is not a byte",
    "ALL CAPS SHOUTING",
] + brown_sentences()


def encode_all(tokenizer, fast):
    cases = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=True).ids
        ids_no_special = tokenizer.encode(text, add_special_tokens=False).ids
        case = {"text": text, "ids": ids, "ids_no_special": ids_no_special,
                "decoded": tokenizer.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tokenizer.decode(ids, skip_special_tokens=True)}
        # transformers' fast tokenizer on the same file must agree (it calls the same library).
        assert fast(text)["input_ids"] == ids, (text, fast(text)["input_ids"], ids)
        assert fast.decode(ids, clean_up_tokenization_spaces=False) == case["decoded"], text
        cases.append(case)
    return cases


def main(out_dir):
    model = sentencepiece_layout(train_pieces())
    documents = {"llama2": llama2_document(model), "mistral": mistral_document(model)}
    for name, document in documents.items():
        directory = os.path.join(out_dir, name)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(document, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                       "add_eos_token": False, "clean_up_tokenization_spaces": False,
                       "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
            f.write("\n")

    variants = {name: (name, {}) for name in documents}
    variants.update(PATCHED_VARIANTS)
    reference = {"tokenizers_version": tokenizers.__version__, "variants": {}}
    for name, (base, patch) in variants.items():
        document = merge_patch(documents[base], patch)
        tokenizer = Tokenizer.from_str(json.dumps(document))
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(document)),
                                       bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        reference["variants"][name] = {"tokenizer": base, "patch": patch, "cases": encode_all(tokenizer, fast)}
    write_reference(os.path.join(out_dir, "reference.json"), reference)


def write_reference(path, reference):
    """Pretty enough to diff, one line per case."""
    def compact(value):
        return json.dumps(value, ensure_ascii=False)

    variants = []
    for name, variant in reference["variants"].items():
        cases = ",\n".join("   " + compact(case) for case in variant["cases"])
        variants.append(f'  {compact(name)}: {{"tokenizer": {compact(variant["tokenizer"])}, '
                        f'"patch": {compact(variant["patch"])}, "cases": [\n{cases}]}}')
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"tokenizers_version": ' + compact(reference["tokenizers_version"]) + ', "variants": {\n')
        f.write(",\n".join(variants) + "\n}}\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "sentencepiece"))
