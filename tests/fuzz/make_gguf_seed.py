#!/usr/bin/env python3
"""Writes tests/fuzz/corpus/gguf/tiny.gguf, the GGUF fuzz target's seed, with gguf-py (the
reference writer): a few metadata types (string, u32, f32, string array) and one F32, one F16
and one Q8_0 tensor (a single block), 512 bytes in all.

    $QTRAIN_PYTHON tests/fuzz/make_gguf_seed.py
"""
import os

import gguf
import numpy as np

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "gguf", "tiny.gguf")
writer = gguf.GGUFWriter(path, "llama")
writer.add_uint32("llama.block_count", 1)
writer.add_float32("llama.rope.freq_base", 10000.0)
writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float16))
block = np.zeros(34, dtype=np.uint8)
block[1] = 0x3C  # d = fp16 1.0 (little-endian 0x3C00)
block[2:] = np.arange(32, dtype=np.uint8)  # q = 0..31
writer.add_tensor("blk.0.ffn_up.weight", block.reshape(1, 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
