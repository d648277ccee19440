"""The type llama.cpp's quantizer gives each tensor, for tests/qat/gguf_file_types_test.cpp.

    python llama_quantize_types.py types MODELS.json WORK_DIR
        MODELS.json: {"models": [{"name": "llama-l8-gqa4", "architecture": "llama",
                                  "hparams": {"block_count": 8, "embedding_length": 256, ...},
                                  "tensors": [{"name": "token_embd.weight", "shape": [64, 256]}, ...],
                                  "file_types": ["Q4_K_M", "Q8_0", ...]}, ...]}
        For each model, writes an all-F32 GGUF file (general.architecture, each hparams entry as the
        uint32 key `<architecture>.<key>`, the tensors in the order given, torch shapes, small random
        values) under WORK_DIR, quantizes it with llama-cpp-python's llama_model_quantize and its
        default parameters (no importance matrix, no --pure, no overrides) to each file type, and
        prints JSON: {"llama_ftypes": {"Q4_K_M": 15, ...} (llama.h's numbers, as llama_cpp names
        them), "models": {"llama-l8-gqa4": {"Q4_K_M": {"file_type": 15, "tensors": {"output.weight":
        "Q6_K", ...}}, "Q4_0": {"error": "..."}, ...}}}: gguf-py's names of the types the quantized
        file holds and its general.file_type, or why llama.cpp refused the model.
"""
import ctypes
import json
import os
import sys

import numpy as np
from script_modes import run_mode

_KEEP_LOG = None


def llama_ftype(llama_cpp, name: str) -> int:
    """llama.h's LLAMA_FTYPE_MOSTLY_<name> (LLAMA_FTYPE_ALL_F32 for F32)."""
    return getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if name == "F32" else f"LLAMA_FTYPE_MOSTLY_{name}")


def write_f32_model(gguf, model, path: str) -> None:
    architecture = model["architecture"]
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in model["hparams"].items():
        writer.add_uint32(f"{architecture}.{key}", int(value))
    writer.add_uint32(f"{architecture}.context_length", 256)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    generator = np.random.default_rng(0)
    for tensor in model["tensors"]:
        values = generator.standard_normal(tensor["shape"]).astype(np.float32) * np.float32(0.02)
        writer.add_tensor(tensor["name"], values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_types(gguf, llama_cpp, log, source: str, out: str, ftype: int):
    """{"file_type": ..., "tensors": {name: type}}, or {"error": llama.cpp's message} when it refuses."""
    log.clear()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 0  # all cores (llama.cpp's hardware_concurrency)
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    if status != 0:
        errors = [line.strip() for line in "".join(log).splitlines() if "failed to quantize" in line]
        return {"error": errors[-1] if errors else f"llama_model_quantize returned {status}"}
    reader = gguf.GGUFReader(out)
    result = {"file_type": int(reader.fields["general.file_type"].contents()),
              "tensors": {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}}
    del reader
    os.remove(out)
    return result


def types(models_path: str, work_dir: str) -> int:
    import gguf
    import llama_cpp

    # llama.cpp's log, kept for the error of a refused model rather than printed; the callback
    # lives as long as the process, since llama.cpp keeps its pointer.
    log = []
    global _KEEP_LOG
    _KEEP_LOG = llama_cpp.llama_log_callback(lambda level, text, user_data: log.append(text.decode("utf-8", "replace")))
    llama_cpp.llama_log_set(_KEEP_LOG, ctypes.c_void_p())
    with open(models_path, encoding="utf-8") as file:
        models = json.load(file)["models"]
    names = sorted({name for model in models for name in model["file_types"]})
    report = {"llama_ftypes": {name: llama_ftype(llama_cpp, name) for name in names}, "models": {}}
    for model in models:
        source = os.path.join(work_dir, f"{model['name']}.source.gguf")
        write_f32_model(gguf, model, source)
        report["models"][model["name"]] = {
            name: quantized_types(gguf, llama_cpp, log, source, os.path.join(work_dir, f"{model['name']}.{name}.gguf"),
                                  llama_ftype(llama_cpp, name))
            for name in model["file_types"]}
        os.remove(source)
    json.dump(report, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(run_mode({"types": types}))
