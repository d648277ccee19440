"""What gguf-py and llama.cpp make of our GGUF export, for tests/trainer/gguf_export_test.cpp.

    python gguf_model.py check MODEL.gguf EXPECTED.safetensors TOKENIZER_DIR ARCHITECTURE
        Opens MODEL.gguf with gguf-py's GGUFReader and checks, for every tensor of EXPECTED (under
        its GGUF name; its __metadata__ maps the name to the expected type, "Q4_0", "F32", ...):
        the type, the shape, and that gguf.quants.dequantize gives exactly the expected values;
        that the file has no other tensors; and the tokenizer metadata against TOKENIZER_DIR's
        tokenizer.json as the tokenizers library reads it (tokens by id, merges, special ids); and
        that general.architecture is ARCHITECTURE (llama, qwen2, qwen3, phi3, gemma2, gemma3), which gguf-py knows.
        Prints what differs and exits 1 on any difference.
    python gguf_model.py quantize-compare F32.gguf PREFIX TYPE...
        For each TYPE (llama.cpp's file type names: Q4_K_M, Q8_0, F16, ...), quantizes F32.gguf with
        llama.cpp's own quantizer (llama_model_quantize, default parameters: no importance matrix)
        and compares PREFIX + TYPE + ".gguf" with it: the same tensors, each of the same type and
        the same bytes, and the same general.file_type. Then llama.cpp loads each of our files and
        evaluates a few tokens (finite logits). Prints what differs and exits 1 on any difference.
    python gguf_model.py same-values F32.gguf QUANTIZED.gguf TYPE
        Every tensor of QUANTIZED.gguf stored as TYPE (gguf-py's name: MXFP4) dequantizes (gguf-py's
        gguf.quants.dequantize) to exactly the values F32.gguf holds under the same name: the
        quantization lost nothing. Prints the count, or what differs and exits 1.
    python gguf_model.py llama-cpp MODEL.gguf TEXT OUT.safetensors
        Runs llama.cpp (llama-cpp-python) on TEXT tokenized by llama.cpp itself (BOS added as the
        file says); writes `input_ids` (int64 [1, T]) and `logits` (fp32 [1, T, vocab]).
"""
import json
import sys

import numpy as np
from script_modes import run_mode


def check(gguf_path: str, expected_path: str, tokenizer_dir: str, architecture: str) -> int:
    import gguf
    from safetensors import safe_open
    from tokenizers import Tokenizer

    reader = gguf.GGUFReader(gguf_path)
    problems = []
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    with safe_open(expected_path, framework="np") as expected:
        types = expected.metadata()
        names = list(expected.keys())
        for name in names:
            values = expected.get_tensor(name)
            if name not in tensors:
                problems.append(f"{name}: missing")
                continue
            tensor = tensors[name]
            if tensor.tensor_type.name != types[name]:
                problems.append(f"{name}: type {tensor.tensor_type.name}, expected {types[name]}")
            # The file records ne in ggml order: the torch shape reversed.
            if list(reversed([int(size) for size in tensor.shape])) != list(values.shape):
                problems.append(f"{name}: shape {list(tensor.shape)} (ggml order), expected {list(values.shape)}")
                continue
            ours = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(values.shape).astype(np.float32)
            if not np.array_equal(ours, values):
                problems.append(f"{name}: dequantized values differ, max |difference| "
                                f"{float(np.abs(ours - values).max())}")
    extra = sorted(set(tensors) - set(names))
    if extra:
        problems.append(f"tensors the export should not have: {extra}")

    def field(key):
        value = reader.fields.get(key)
        if value is None:
            problems.append(f"metadata {key} is missing")
            return None
        return value.contents()

    # gguf-py's own table of the architecture's tensors: every one we wrote must be in it.
    known = {arch_name: arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items()}
    if architecture not in known:
        problems.append(f"gguf-py knows no architecture {architecture!r}")
    else:
        architecture_tensors = {gguf.TENSOR_NAMES[tensor] for tensor in gguf.MODEL_TENSORS[known[architecture]]}
        for name in tensors:
            base = name.rsplit(".", 1)[0]
            if "blk." in base:
                base = "blk.{bid}." + base.split(".", 2)[2]
            if base not in architecture_tensors:
                problems.append(f"{name}: not a tensor of gguf-py's {architecture}")

    tokenizer = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    vocab_size = int(field(f"{architecture}.vocab_size"))
    by_id = {token_id: token for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()}
    tokens = field("tokenizer.ggml.tokens")
    want = [by_id.get(index, f"[PAD{index}]") for index in range(vocab_size)]
    if tokens != want:
        mismatched = [index for index in range(min(len(tokens), len(want))) if tokens[index] != want[index]]
        problems.append(f"tokenizer.ggml.tokens: {len(tokens)} tokens, {len(mismatched)} differ from tokenizers' vocab "
                        f"(first at {mismatched[:3]})")
    with open(f"{tokenizer_dir}/tokenizer.json", encoding="utf-8") as file:
        document = json.load(file)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in document["model"]["merges"]]
    if field("tokenizer.ggml.merges") != merges:
        problems.append("tokenizer.ggml.merges differ from tokenizer.json's merges")
    token_types = field("tokenizer.ggml.token_type")
    special_ids = {token["id"] for token in document["added_tokens"] if token["special"]}
    for index in special_ids:
        if token_types[index] != gguf.TokenType.CONTROL:
            problems.append(f"token {index} is special but has type {token_types[index]}")
    for key, value in (("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "llama-bpe"),
                       ("general.architecture", architecture)):
        if field(key) != value:
            problems.append(f"{key} = {field(key)!r}, expected {value!r}")
    with open(f"{tokenizer_dir}/tokenizer_config.json", encoding="utf-8") as file:
        config = json.load(file)
    for key, token in (("tokenizer.ggml.bos_token_id", config.get("bos_token")),
                       ("tokenizer.ggml.eos_token_id", config.get("eos_token"))):
        if token is not None and field(key) != tokenizer.token_to_id(token):
            problems.append(f"{key} = {field(key)}, tokenizer_config.json names {token!r} = {tokenizer.token_to_id(token)}")

    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"gguf-py read {len(tensors)} tensors and {len(reader.fields)} metadata fields; {len(problems)} problems")
    return 1 if problems else 0


def llama_cpp_logits(gguf_path: str, text: str, out_path: str) -> int:
    import torch
    from llama_cpp import Llama
    from safetensors.torch import save_file

    model = Llama(model_path=gguf_path, n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    input_ids = model.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    model.eval(input_ids)
    logits = np.array(model.scores[: len(input_ids)], dtype=np.float32)
    save_file({"input_ids": torch.tensor([input_ids], dtype=torch.int64),
               "logits": torch.from_numpy(logits).unsqueeze(0).contiguous()}, out_path)
    return 0


def llama_cpp_file_type(name: str) -> int:
    import llama_cpp
    return llama_cpp.LLAMA_FTYPE_ALL_F32 if name == "F32" else getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")


# GGUF's metadata value types (the format's table; gguf-py's GGUFValueType): the fixed sizes.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def tensor_table(path: str) -> tuple[dict, int]:
    """({name: (ggml type, raw bytes)}, general.file_type) of a GGUF file, read straight from its
    header. gguf-py's GGUFReader builds an object for every metadata value, each token of the
    vocabulary included (about a second a file with tiny-llama's 8,192), where comparing bytes
    needs only the tensor table."""
    import struct

    import gguf

    blob = open(path, "rb").read()
    magic, _, tensor_count, kv_count = struct.unpack_from("<4sIQQ", blob, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    offset = 24

    def string() -> str:
        nonlocal offset
        (length,) = struct.unpack_from("<Q", blob, offset)
        offset += 8 + length
        return blob[offset - length:offset].decode("utf-8")

    def skip(value_type: int) -> None:
        nonlocal offset
        if value_type == _STRING:
            (length,) = struct.unpack_from("<Q", blob, offset)
            offset += 8 + length
        elif value_type == _ARRAY:
            element_type, count = struct.unpack_from("<IQ", blob, offset)
            offset += 12
            if element_type in _SCALAR_BYTES:
                offset += count * _SCALAR_BYTES[element_type]
            else:
                for _ in range(count):
                    skip(element_type)
        else:
            offset += _SCALAR_BYTES[value_type]

    uint32_values = {}  # the metadata's uint32 values by key (general.file_type, general.alignment)
    for _ in range(kv_count):
        key = string()
        (value_type,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if value_type == 4:
            uint32_values[key] = struct.unpack_from("<I", blob, offset)[0]
        skip(value_type)
    file_type, alignment = uint32_values.get("general.file_type"), uint32_values.get("general.alignment", 32)
    infos = []
    for _ in range(tensor_count):
        name = string()
        (dims,) = struct.unpack_from("<I", blob, offset)
        shape = struct.unpack_from(f"<{dims}Q", blob, offset + 4)
        tensor_type, data_offset = struct.unpack_from("<IQ", blob, offset + 4 + 8 * dims)
        offset += 4 + 8 * dims + 12
        infos.append((name, shape, tensor_type, data_offset))
    data_start = (offset + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, tensor_type, data_offset in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor_type)]
        size = int(np.prod(shape)) // block * block_bytes
        start = data_start + data_offset
        tensors[name] = (gguf.GGMLQuantizationType(tensor_type), blob[start:start + size])
    return tensors, file_type


def same_values(f32_path: str, quantized_path: str, type_name: str) -> int:
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    exact = {tensor.name: tensor for tensor in gguf.GGUFReader(f32_path).tensors}
    problems, compared = [], 0
    for tensor in gguf.GGUFReader(quantized_path).tensors:
        if tensor.tensor_type != kind:
            continue
        compared += 1
        values = gguf.quants.dequantize(tensor.data, kind).reshape(-1)
        expected = np.asarray(exact[tensor.name].data, dtype=np.float32).reshape(-1)
        if values.shape != expected.shape or not np.array_equal(values, expected):
            differing = int(np.sum(values != expected)) if values.shape == expected.shape else -1
            problems.append(f"{tensor.name}: {differing} of {expected.size} values differ")
    for problem in problems:
        print(problem)
    print(f"{type_name}: {compared - len(problems)} of {compared} tensors hold exactly the F32 file's values")
    return 1 if problems or compared == 0 else 0


def quantize_compare(f32_path: str, prefix: str, *type_names: str) -> int:
    import ctypes
    import os
    import tempfile

    import llama_cpp

    problems = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in type_names:
            ours_path = f"{prefix}{name}.gguf"
            theirs_path = os.path.join(scratch, f"{name}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp_file_type(name)
            params.nthread = 2
            status = llama_cpp.llama_model_quantize(f32_path.encode(), theirs_path.encode(), ctypes.byref(params))
            if status != 0:
                problems.append(f"{name}: llama_model_quantize failed ({status})")
                continue
            (ours_tensors, our_file_type), (theirs_tensors, their_file_type) = tensor_table(ours_path), tensor_table(theirs_path)
            if sorted(ours_tensors) != sorted(theirs_tensors):
                problems.append(f"{name}: tensors {sorted(set(ours_tensors) ^ set(theirs_tensors))} are in one file only")
            equal = 0
            for tensor_name, (tensor_type, data) in theirs_tensors.items():
                if tensor_name not in ours_tensors:
                    continue
                my_type, my_data = ours_tensors[tensor_name]
                if my_type != tensor_type:
                    problems.append(f"{name}: {tensor_name} is {my_type.name}, llama.cpp wrote {tensor_type.name}")
                elif my_data != data:
                    mine, theirs = np.frombuffer(my_data, np.uint8), np.frombuffer(data, np.uint8)
                    differing = int(np.count_nonzero(mine != theirs)) if mine.size == theirs.size else max(mine.size, theirs.size)
                    problems.append(f"{name}: {tensor_name} ({tensor_type.name}) has {differing} bytes unlike llama.cpp's")
                else:
                    equal += 1
            file_types = [our_file_type, their_file_type]
            if file_types[0] != file_types[1]:
                problems.append(f"{name}: general.file_type {file_types[0]}, llama.cpp wrote {file_types[1]}")
            model = llama_cpp.Llama(model_path=ours_path, n_ctx=64, n_batch=64, logits_all=True, n_threads=2, verbose=False)
            tokens = model.tokenize(b"The jury said the election was conducted.", add_bos=True, special=False)
            model.eval(tokens)
            if not np.isfinite(np.array(model.scores[: len(tokens)])).all():
                problems.append(f"{name}: llama.cpp's logits of our file are not finite")
            del model
            print(f"{name}: {equal} of {len(theirs_tensors)} tensors byte for byte as llama_model_quantize's")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(run_mode({"check": check, "llama-cpp": llama_cpp_logits, "quantize-compare": quantize_compare,
                       "same-values": same_values}))
