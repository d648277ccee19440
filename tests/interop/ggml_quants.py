"""llama.cpp's own quantizers (ggml, as llama-cpp-python ships it), for tests/qat/gguf_quants_test.cpp.

    python ggml_quants.py quantize VALUES.f32 ROW_LENGTH OUT_DIR TYPE [TYPE...]
        Reads VALUES.f32 (raw little-endian float32, rows of ROW_LENGTH values) and, for each TYPE
        (gguf-py's GGMLQuantizationType names: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, ..., Q6_K), writes
        OUT_DIR/TYPE.quantized: the blocks ggml_quantize_chunk makes of them without an importance
        matrix (what llama-quantize writes), and OUT_DIR/TYPE.dequantized: those blocks back to
        float32 through the type's to_float (ggml_get_type_traits). Checks first that ggml's table
        agrees with gguf-py's on the type's name, block size and bytes; exits 1 if not.
"""
import ctypes
import importlib.util
import pathlib
import sys

import numpy as np
from script_modes import run_mode


class TypeTraits(ctypes.Structure):
    """ggml.h's struct ggml_type_traits, up to to_float."""
    _fields_ = [("type_name", ctypes.c_char_p),
                ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64))]


def load_ggml() -> ctypes.CDLL:
    """libggml-base, where the quantizers live, from llama-cpp-python's own lib folder (not imported:
    the package would load all of llama.cpp)."""
    package = pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent
    ggml = ctypes.CDLL(str(package / "lib" / "libggml-base.so"))
    ggml.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    ggml.ggml_get_type_traits.argtypes = [ctypes.c_int]
    ggml.ggml_quantize_init.argtypes = [ctypes.c_int]
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return ggml


def quantize(values_path: str, row_length: str, out_dir: str, *type_names: str) -> int:
    import gguf

    ggml = load_ggml()
    values = np.fromfile(values_path, dtype="<f4")
    per_row = int(row_length)
    if per_row <= 0 or values.size % per_row != 0:
        print(f"{values_path}: {values.size} values are not rows of {per_row}", file=sys.stderr)
        return 1
    rows = values.size // per_row
    for name in type_names:
        if name not in gguf.GGMLQuantizationType.__members__:
            print(f"gguf-py knows no type {name!r}", file=sys.stderr)
            return 1
        quant_type = gguf.GGMLQuantizationType[name]
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
        traits = ggml.ggml_get_type_traits(quant_type.value).contents
        if (traits.type_name.decode().lower() != name.lower() or traits.blck_size != block_elements
                or traits.type_size != block_bytes or not traits.is_quantized):
            print(f"{name}: ggml's type {quant_type.value} is {traits.type_name.decode()!r} with blocks of "
                  f"{traits.blck_size} values in {traits.type_size} bytes; gguf-py says {block_elements} in "
                  f"{block_bytes}", file=sys.stderr)
            return 1
        if per_row % block_elements != 0:
            print(f"{name}: rows of {per_row} values are not whole blocks of {block_elements}", file=sys.stderr)
            return 1
        quantized = np.zeros(values.size // block_elements * block_bytes, dtype=np.uint8)
        ggml.ggml_quantize_init(quant_type.value)
        written = ggml.ggml_quantize_chunk(quant_type.value, values.ctypes.data, quantized.ctypes.data, 0, rows,
                                           per_row, None)
        if written != quantized.size:
            print(f"{name}: ggml_quantize_chunk wrote {written} bytes, expected {quantized.size}", file=sys.stderr)
            return 1
        dequantized = np.zeros(values.size, dtype="<f4")
        traits.to_float(quantized.ctypes.data, dequantized.ctypes.data, values.size)
        quantized.tofile(f"{out_dir}/{name}.quantized")
        dequantized.tofile(f"{out_dir}/{name}.dequantized")
    print(f"ggml quantized {rows} rows of {per_row} values as {', '.join(type_names)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_mode({"quantize": quantize}))
