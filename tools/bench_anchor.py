#!/usr/bin/env python3
"""The Python anchor of `qtrain bench`: the same training step in transformers + peft (+ bitsandbytes
for QLoRA), same shapes and settings, so the two can be compared on one machine (tools/bench.sh).

Random weights are made on the device; QLoRA quantizes the projections with bitsandbytes'
Linear4bit (NF4, double quantization, blocks of 64, bf16 compute; lm_head kept), as
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`
loads a checkpoint. LoRA r16 alpha 32 on the 7 projections, dropout 0, torch AdamW lr 1e-4,
gradient clipping at 1, SDPA attention, non-reentrant checkpointing when asked. Prints the median
step's tokens/s and the peak allocated memory, and with --json one JSON object.
"""
import argparse
import json
import statistics
import sys
import time

import torch

from bench_arguments import add_row_arguments

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "llama3-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=688, vocab_size=32000),
    # The families' shapes, as qtrain bench's (trainer/model/llama_shapes.cpp); config_class picks the model.
    "qwen3-8b": dict(config_class="Qwen3Config", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(config_class="Qwen2Config", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
                       rms_norm_eps=1e-6),
    "mistral-7b": dict(config_class="MistralConfig", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None),
}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def quantize_projections(model, dtype):
    import bitsandbytes as bnb
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and name in PROJECTIONS:
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                              device="meta")
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                     compress_statistics=True, blocksize=64)
                quantized.weight = quantized.weight.to(child.weight.device)  # quantizes
                setattr(module, name, quantized)
                del child
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    add_row_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    import peft
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    shape = dict(SHAPES[args.shape])
    if not 0 <= args.layers <= shape["num_hidden_layers"]:
        parser.error(f"--layers {args.layers}: {args.shape} has {shape['num_hidden_layers']} layers")
    shape["num_hidden_layers"] = args.layers or shape["num_hidden_layers"]
    config_class = getattr(transformers, shape.pop("config_class", "LlamaConfig"))
    shape.setdefault("rope_theta", 500000.0)
    config = config_class(**shape, max_position_embeddings=max(args.seq, 8192), tie_word_embeddings=False,
                          attn_implementation="sdpa", use_cache=False)
    start = time.time()
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    if args.quant == "qlora":
        quantize_projections(model, dtype)
    model.requires_grad_(False)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    print(f"anchor: model built in {time.time() - start:.1f} s", flush=True)

    input_ids = torch.randint(config.vocab_size, (args.micro_batch, args.seq), device=device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        synchronize()
        began = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - began)
    median = statistics.median(seconds)
    tokens_per_second = args.micro_batch * args.seq / median
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    versions = f"transformers {transformers.__version__}, peft {peft.__version__}"
    if args.quant == "qlora":
        import bitsandbytes
        versions += f", bitsandbytes {bitsandbytes.__version__}"
    print(f"anchor: {args.shape} {args.quant}, micro-batch {args.micro_batch} x {args.seq}, checkpointing "
          f"{'on' if args.checkpointing else 'off'} ({versions})")
    print(f"  {tokens_per_second:.0f} tokens/s (median of {args.steps} steps, {median:.3f} s each), "
          f"peak memory {peak / 2**30:.2f} GiB")
    if args.json:
        print(json.dumps(dict(shape=args.shape, layers=config.num_hidden_layers, quant=args.quant,
                              micro_batch=args.micro_batch, seq=args.seq, checkpointing=args.checkpointing,
                              tokens_per_second=tokens_per_second, peak_memory_bytes=peak, step_seconds=median,
                              versions=versions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
