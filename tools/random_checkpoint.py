#!/usr/bin/env python3
"""A Llama-3-8B- or 70B-shaped Hugging Face checkpoint with random bf16 weights, for benchmarks of the
real training command (`qtrain --recipe`) where `qtrain bench` is not enough (several ranks), and
of peers that load from disk (tools/bench_unsloth.py).

    tools/random_checkpoint.py OUT_DIR [--device cuda] [--layers N] [--shape llama3-70b] [--bnb-4bit]

Writes config.json (Meta-Llama-3-8B's or -70B's), model-0000K-of-0000N.safetensors shards of about
5 GB with model.safetensors.index.json, and the bundled tiny model's tokenizer files (its ids all
lie inside the 128,256-token vocabulary, so speed is all they are good for). Weights are drawn as
N(0, 0.02), norms are ones; the tensors are made on --device (fast on a GPU) one at a time, and
each shard is written as it fills.

--bnb-4bit writes the projections already quantized, as transformers' save_pretrained writes a
model loaded with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16): bitsandbytes' own
quantize_4bit (bitsandbytes needed; a GPU for a whole 70B) and its packed quant state beside each weight,
the embeddings, norms and lm_head in bf16, config.json's quantization_config. A 70B checkpoint is
then about 39 GB instead of 141, which the GPU machine's 64 GB disk holds.
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "recipes/demo/tiny-llama")

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 4,
}


# meta-llama/Meta-Llama-3-70B's config.json: the keys that differ from the 8B's.
SHAPES = {
    "llama3-8b": {},
    "llama3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8},
}

# transformers' BitsAndBytesConfig(load_in_4bit=True, nf4, double quant, bf16 compute).to_dict().
BNB_4BIT = {
    "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
    "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None, "llm_int8_enable_fp32_cpu_offload": False,
    "llm_int8_has_fp16_weight": False,
}


def quantized(name, shape):
    """Whether --bnb-4bit stores this tensor in 4 bits: the decoder's projections (transformers keeps
    the embeddings, norms and lm_head in the compute dtype)."""
    return len(shape) == 2 and name.startswith("model.layers.")


def tensor_shapes(config):
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    yield "model.embed_tokens.weight", [config["vocab_size"], hidden]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", [hidden]
        yield f"{prefix}.self_attn.q_proj.weight", [q_width, hidden]
        yield f"{prefix}.self_attn.k_proj.weight", [kv_width, hidden]
        yield f"{prefix}.self_attn.v_proj.weight", [kv_width, hidden]
        yield f"{prefix}.self_attn.o_proj.weight", [hidden, q_width]
        yield f"{prefix}.post_attention_layernorm.weight", [hidden]
        yield f"{prefix}.mlp.gate_proj.weight", [inter, hidden]
        yield f"{prefix}.mlp.up_proj.weight", [inter, hidden]
        yield f"{prefix}.mlp.down_proj.weight", [hidden, inter]
    yield "model.norm.weight", [hidden]
    yield "lm_head.weight", [config["vocab_size"], hidden]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, help="the first N layers only (default: all of the shape's)")
    parser.add_argument("--shard-bytes", type=int, default=5 * 10**9)
    parser.add_argument("--bnb-4bit", action="store_true",
                        help="the projections NF4 with double quantization, as bitsandbytes stores them")
    args = parser.parse_args()
    config = dict(CONFIG, **SHAPES[args.shape])
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    if args.bnb_4bit:
        import bitsandbytes.functional as bnb_functional  # on the CPU too from bitsandbytes 0.46 on (slowly)
        config["quantization_config"] = BNB_4BIT
    os.makedirs(args.out, exist_ok=True)

    generator = torch.Generator(device=args.device).manual_seed(0)
    # Shards go to disk as they fill (a 70B checkpoint is more than the host's memory in bf16),
    # named model-K.partial.safetensors until their count is known.
    written, shard, shard_bytes = [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        file_name = f"model-{len(written) + 1:05d}.partial.safetensors"
        save_file(shard, os.path.join(args.out, file_name), metadata={"format": "pt"})
        written.append((file_name, list(shard), shard_bytes))
        shard, shard_bytes = {}, 0

    for name, shape in tensor_shapes(config):
        if len(shape) == 1:
            tensors = {name: torch.ones(shape, dtype=torch.bfloat16)}
        else:
            weight = torch.empty(shape, dtype=torch.bfloat16, device=args.device).normal_(0, 0.02, generator=generator)
            tensors = {name: weight}
            if args.bnb_4bit and quantized(name, shape):
                packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=True,
                                                            quant_type="nf4", quant_storage=torch.uint8)
                tensors = {name: packed, **{f"{name}.{key}": value for key, value in state.as_dict(packed=True).items()}}
        for key, tensor in tensors.items():
            shard[key] = tensor.cpu()
            shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= args.shard_bytes:
            flush()
    if shard:
        flush()

    weight_map, total = {}, 0
    for index, (partial_name, names, size) in enumerate(written):
        file_name = f"model-{index + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(os.path.join(args.out, partial_name), os.path.join(args.out, file_name))
        weight_map.update({name: file_name for name in names})
        total += size
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=1)
    with open(os.path.join(args.out, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), args.out)
    print(f"random_checkpoint: {args.out}: {args.shape}, {config['num_hidden_layers']} layers"
          f"{', NF4 projections' if args.bnb_4bit else ''}, {len(written)} shards, {total / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
