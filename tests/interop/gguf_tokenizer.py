"""llama.cpp's tokenization of a GGUF file's tokenizer, and byte-level tokenizers to export, for
tests/trainer/gguf_tokenizer_test.cpp.

    python gguf_tokenizer.py tokenize MODEL.gguf TEXTS.json OUT.json
        Opens MODEL.gguf with llama.cpp (llama-cpp-python, vocab_only) and tokenizes every string of
        TEXTS (a JSON list) with and without the BOS / EOS the file says to add; writes
        {"with_special": [[ids], ...], "without_special": [[ids], ...]}. Special-token text in a
        string ("</s>") is parsed as the special token (llama.cpp's parse_special), as the
        tokenizers library always does; without it llama.cpp reads such text as plain characters.
    python gguf_tokenizer.py make-byte-level OUT_DIR NAME
        Trains a byte-level BPE (every byte in the alphabet, so any text encodes) on the first
        Brown documents (../shared/data/brown) with the pre_tokenizer and model.ignore_merges that
        the tokenizer.json files of the models llama.cpp calls NAME (its tokenizer.ggml.pre) have,
        e.g. "gpt-4o": o200k's Split regex + ByteLevel(use_regex=false), as Phi-4-mini's and
        GPT-4o's. Special tokens <|endoftext|> (BOS and EOS) and </s>, and a non-special added
        token [INST]. Writes OUT_DIR/tokenizer.json and tokenizer_config.json. Deterministic.
"""
import json
import os
import sys

from script_modes import run_mode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Beside the fixtures (QTRAIN_FIXTURES, as the tests find them), else beside the clone.
SHARED = (os.path.dirname(os.path.normpath(os.environ["QTRAIN_FIXTURES"])) if os.environ.get("QTRAIN_FIXTURES")
          else os.path.join(ROOT, "..", "shared"))
BROWN = os.path.join(SHARED, "data", "brown", "train.jsonl")
TRAIN_DOCUMENTS = 60
VOCAB_SIZE = 1200
SPECIAL_TOKENS = ["<|endoftext|>", "</s>"]
PLAIN_ADDED_TOKENS = ["[INST]"]


def tokenize(gguf_path: str, texts_path: str, out_path: str) -> int:
    from llama_cpp import Llama

    with open(texts_path, encoding="utf-8") as file:
        texts = json.load(file)
    model = Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    result = {"with_special": [], "without_special": []}
    for text in texts:
        for key, add_special in (("with_special", True), ("without_special", False)):
            result[key].append(model.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))
    with open(out_path, "w", encoding="utf-8") as file:
        json.dump(result, file)
    return 0


def split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def split_then_bytes(*regexes):
    return {"type": "Sequence", "pretokenizers": [split(regex) for regex in regexes] + [byte_level(False)]}


LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# The pre-tokenizers of the files convert_hf_to_gguf.py names so, as (pre_tokenizer, ignore_merges).
PRE_TOKENIZERS = {
    "llama-bpe": (split_then_bytes(LLAMA3), True),
    "dbrx": (split_then_bytes(LLAMA3), False),
    "qwen2": (split_then_bytes(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), False),
    "qwen35": (split_then_bytes(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|"
        r"\s+(?!\S)|\s+"), False),
    "gpt-4o": (split_then_bytes(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
        r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), False),
    "tekken": (split_then_bytes(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
        r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), True),
    "seed-coder": (split_then_bytes(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\r\n]+|\\s*[\r\n]+|"
        "\\s+(?!\\S)|\\s+"), False),
    "bailingmoe": (split_then_bytes(
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"), False),
    "exaone-moe": (split_then_bytes(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|"
        r"\s*[\r\n]|\s+(?!\S)|\s+"), False),
    "jais-2": (split_then_bytes(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
        r"\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|"
        r"\s{1,2}(?!\S)|\s{1}"), False),
    "deepseek-v3": (split_then_bytes(
        r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
        "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"), False),
    "deepseek-coder": ({"type": "Sequence", "pretokenizers": [
        split("[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"), split("[一-龥ࠀ-一가-퟿]+"),
        {"type": "Digits", "individual_digits": True}, byte_level(False)]}, False),
    "gpt-2": (byte_level(True), False),
    "starcoder": ({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level(True)]}, False),
}


def training_texts():
    with open(BROWN, encoding="utf-8") as file:
        return [json.loads(line)["text"] for _, line in zip(range(TRAIN_DOCUMENTS), file)]


def make_byte_level(out_dir: str, name: str) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    pre_tokenizer_json, ignore_merges = PRE_TOKENIZERS[name]
    # The library builds the pre-tokenizer from its JSON form, as it reads a tokenizer.json.
    document = json.loads(Tokenizer(models.BPE()).to_str())
    document["pre_tokenizer"] = pre_tokenizer_json
    tokenizer = Tokenizer.from_str(json.dumps(document))
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_texts(), trainer)
    tokenizer.add_tokens([AddedToken(content, special=False, normalized=False) for content in PLAIN_ADDED_TOKENS])
    document = json.loads(tokenizer.to_str())
    document["model"]["ignore_merges"] = ignore_merges
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as file:
        json.dump(document, file, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as file:
        json.dump({"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[0],
                   "tokenizer_class": "PreTrainedTokenizerFast"}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(run_mode({"tokenize": tokenize, "make-byte-level": make_byte_level}))
