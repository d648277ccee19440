#!/usr/bin/env python3
"""The Unsloth anchor of `qtrain bench`: the same training step in Unsloth, same shape and settings,
so that the two can be compared on one GPU (tools/bench.sh).

Unsloth loads from disk, so the first run writes a random bf16 checkpoint and later runs reuse it.
llama3-8b: tools/random_checkpoint.py's Llama-3-8B shape, with a tokenizer of its 128,256 ids, into
$QTRAIN_BENCH_CHECKPOINT (default /tmp/qtrain-bench-llama3-8b, about 16 GB; with --layers N < 32,
that path + "-LN"). qwen3-30b-a3b, gpt-oss-20b (mixtures of experts): the real config.json (gpt-oss
with bf16 experts instead of its MXFP4) cut to --layers N, default 12, as the whole bf16
checkpoints (61 / 42 GB) do not fit the GPU machine's 64 GB disk; at 12 layers about 16 / 22 GB.
It is built with transformers' own init (std 0.02) on the GPU in a separate process (Unsloth not
imported there, its memory gone before the load), with a tokenizer holding the model's real special
tokens at their ids, into $QTRAIN_BENCH_CHECKPOINT_DIR (default /tmp) as ubench_<family>_L<N>: no
model name in the path, since Unsloth special-cases names. Unsloth's own recipe:
FastLanguageModel.from_pretrained (load_in_4bit for QLoRA, NF4), get_peft_model with LoRA r16
alpha 32 dropout 0 on the 7 projections (for the mixtures Unsloth adds the fused expert Parameters
as peft target_parameters), its default use_gradient_checkpointing="unsloth" (which offloads
activations to the host) with --checkpointing and False without; then a plain loop on random token
ids: forward with labels under bf16 autocast, backward, clipping at 1, torch AdamW lr 1e-4 on the
LoRA weights. Prints the median step's tokens/s and the peak allocated memory of the timed steps
(reset after warm-up, as qtrain bench does), and with --json one JSON object (with "oom" on running
out of memory, "error" where it could not run; for the mixtures also what was quantized to 4 bits
and what got LoRA, by name pattern).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback

from bench_arguments import add_row_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = os.path.abspath(os.environ.get("QTRAIN_BENCH_CHECKPOINT", "/tmp/qtrain-bench-llama3-8b"))
CHECKPOINT_DIR = os.path.abspath(os.environ.get("QTRAIN_BENCH_CHECKPOINT_DIR", "/tmp"))
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA_LAYERS = 32
MOE_DEFAULT_LAYERS = 12
# The mixtures of experts (as .gpu/unsloth_moe_bench.py): their config.json, the transformers classes.
MOE_SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": dict(full_layers=48, tag="qwen3moe", classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False, attention_dropout=0.0,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False, use_sliding_window=False,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, initializer_range=0.02)),
    # openai/gpt-oss-20b config.json (bf16 instead of its MXFP4 experts)
    "gpt-oss-20b": dict(full_layers=24, tag="gptoss", classes=("GptOssConfig", "GptOssForCausalLM"), config=dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 4096},
        attention_bias=True, attention_dropout=0.0, router_aux_loss_coef=0.9, output_router_logits=False,
        tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999, initializer_range=0.02)),
}
SHAPES = ["llama3-8b", *MOE_SHAPES]


def write_moe_tokenizer(shape, path):
    """A word-level tokenizer over the model's ids with its real special tokens at their real ids
    (the strings are arbitrary, the bench feeds random ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    if shape == "qwen3-30b-a3b":
        first = 151643
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
                    "</tool_response>", "<think>", "</think>"]
        named = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    else:
        first = 199998
        known = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
        specials = [known.get(i, f"<|reserved_{i}|>") for i in range(first, 200019)]
        named = dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>")
    vocab = {f"t{i}": i for i in range(first)}
    vocab.update({token: first + index for index, token in enumerate(specials)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=131072, **named)
    fast.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in named.values()]})
    fast.save_pretrained(path)
    return len(fast)


def write_moe_checkpoint(shape, layers, path):
    """The random bf16 checkpoint of SHAPE's first LAYERS layers (transformers' init, built on the GPU,
    shards of 2 GB) and its tokenizer, into PATH.partial, then renamed to PATH. Runs in its own process
    (--write-checkpoint): Unsloth must not be imported here."""
    import torch
    import transformers
    spec = MOE_SHAPES[shape]
    config_class, model_class = (getattr(transformers, name) for name in spec["classes"])
    extra = {}
    if shape == "gpt-oss-20b":
        extra["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if shape == "qwen3-30b-a3b":
        extra["max_window_layers"] = layers
    config = config_class(num_hidden_layers=layers, **spec["config"], **extra)
    start = time.time()
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_class(config)
    model = model.to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise SystemExit(f"bench_unsloth: non-finite init in {bad[:4]}")
    model.config.dtype = "bfloat16"
    model.save_pretrained(partial, max_shard_size="2GB")
    del model
    tokens = write_moe_tokenizer(shape, partial)
    os.replace(partial, path)
    print(f"bench_unsloth: wrote {path}: {shape}, {layers} layers, {count / 1e9:.2f} B weights, tokenizer of "
          f"{tokens} ids, in {time.time() - start:.0f} s", flush=True)


def moe_checkpoint_path(shape, layers):
    # No model name in it: Unsloth special-cases names holding "gpt-oss-20b" or a hub repository's.
    return os.path.join(CHECKPOINT_DIR, f"ubench_{MOE_SHAPES[shape]['tag']}_L{layers}")


def moe_checkpoint(shape, layers):
    """SHAPE's checkpoint of LAYERS layers, written by a separate process where it is not on disk yet."""
    path = moe_checkpoint_path(shape, layers)
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"bench_unsloth: writing the random checkpoint into {path} (once)", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--shape", shape, "--layers", str(layers),
                        "--write-checkpoint"], check=True)
    return path


def pattern(name):
    """A parameter's name with its layer and expert indices as *."""
    return re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", name))


def quantized_report(model):
    """What from_pretrained quantized: 4-bit parameters (the fused 3-D expert stacks included) and
    Linear4bit modules, and the big parameters it left alone, by name pattern."""
    quantized, unquantized = {}, {}
    for name, p in model.named_parameters():
        if type(p).__name__ == "Params4bit":
            shape = (getattr(p, "_original_shape", None) or getattr(getattr(p, "quant_state", None), "shape", None)
                     or p.shape)
            quantized.setdefault(pattern(name), [0, list(shape)])[0] += 1
        elif p.numel() >= 1 << 20:
            unquantized.setdefault(pattern(name), [0, list(p.shape), str(p.dtype)])[0] += 1
    linear4bit = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit")
    return dict(quantized_4bit=quantized, unquantized_big=unquantized, linear4bit_modules=linear4bit)


def lora_report(model):
    """What got LoRA: trainable tensors and LoRA wrappers by name pattern, peft's target_parameters."""
    trainable = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            entry = trainable.setdefault(pattern(name), [0, 0, list(p.shape)])
            entry[0] += 1
            entry[1] += p.numel()
    wrappers = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if hasattr(module, "lora_A") and kind != "ModuleDict":
            parameter = f"[{module.parameter_name}]" if hasattr(module, "parameter_name") else ""
            key = f"{kind}:{pattern(name)}{parameter}"
            wrappers[key] = wrappers.get(key, 0) + 1
    configs = getattr(model, "peft_config", {}).values()
    targets = sorted({t for c in configs for t in (getattr(c, "target_parameters", None) or [])})
    return dict(trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                trainable_tensors=sum(1 for p in model.parameters() if p.requires_grad),
                trainable_by_pattern=trainable, lora_wrappers=wrappers, peft_target_parameters=targets)


def write_tokenizer(path):
    """A word-level tokenizer over the 128,256 ids, Llama-3's specials at 128,000 on (as .gpu/make_tok.py):
    Unsloth's loader wants one; the strings are arbitrary, the bench feeds random ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(128000)}
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    vocab.update({token: 128000 + index for index, token in enumerate(specials)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                            pad_token="<|reserved_special_token_2|>", model_max_length=8192).save_pretrained(path)


def write_checkpoint(path, *flags):
    """tools/random_checkpoint.py into PATH.partial (FLAGS passed on), its tokenizer replaced by one of the
    model's vocabulary and config.json given Llama-3's bos / eos ids; then renamed to PATH."""
    partial = path + ".partial"
    print(f"bench_unsloth: writing the random checkpoint into {path} (once)", flush=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/random_checkpoint.py"), partial, *flags], check=True)
    write_tokenizer(partial)
    with open(os.path.join(partial, "config.json")) as file:
        config = json.load(file)
    import transformers
    config.update(bos_token_id=128000, eos_token_id=128001, transformers_version=transformers.__version__)
    with open(os.path.join(partial, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    os.rename(partial, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b",
                        help=", ".join(SHAPES) + " (a random checkpoint of the shape on disk)")
    add_row_arguments(parser)
    parser.add_argument("--check", action="store_true",
                        help="only test that this can run: the shape, a GPU, `import unsloth` (exit 0 if so)")
    parser.add_argument("--write-checkpoint", action="store_true", help=argparse.SUPPRESS)  # the separate process
    args = parser.parse_args()
    result = dict(shape=args.shape, quant=args.quant, micro_batch=args.micro_batch, seq=args.seq,
                  checkpointing=args.checkpointing)

    def fail(message):
        print(f"bench_unsloth: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(result, error=message)))
        return 1

    if args.shape not in SHAPES:
        return fail(f"--shape {args.shape}: only {', '.join(SHAPES)} are benchmarked here (Unsloth loads a random "
                    "checkpoint of the shape from disk)")
    moe = args.shape in MOE_SHAPES
    full = MOE_SHAPES[args.shape]["full_layers"] if moe else LLAMA_LAYERS
    layers = args.layers or (MOE_DEFAULT_LAYERS if moe else LLAMA_LAYERS)
    if not 0 < layers <= full:
        return fail(f"--layers {args.layers}: {args.shape} has {full} layers")
    result["layers"] = layers
    if args.write_checkpoint:
        if not moe:
            return fail("--write-checkpoint is for the mixtures of experts' shapes")
        write_moe_checkpoint(args.shape, layers, moe_checkpoint_path(args.shape, layers))
        return 0
    import torch
    if not torch.cuda.is_available():
        return fail("no CUDA GPU: Unsloth's training step runs on an NVIDIA GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    path = CHECKPOINT if layers == LLAMA_LAYERS else f"{CHECKPOINT}-L{layers}"
    if moe and not args.check:
        # Before `import unsloth`: the writing process starts with none of Unsloth's patches or settings.
        try:
            path = moe_checkpoint(args.shape, layers)
        except subprocess.CalledProcessError as error:
            return fail(f"writing the random {args.shape} checkpoint failed (exit {error.returncode})")
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "qtrain-bench-unsloth")
    os.makedirs(work, exist_ok=True)
    os.chdir(work)  # Unsloth writes its compiled cache (unsloth_compiled_cache/) into the working directory
    try:
        import unsloth  # before transformers and peft, as Unsloth asks
        from unsloth import FastLanguageModel
    except Exception as error:  # noqa: BLE001 (Unsloth raises several kinds where it cannot run)
        hint = "; tools/bench.sh puts $QTRAIN_UNSLOTH_PATH on PYTHONPATH" if isinstance(error, ImportError) else ""
        return fail(f"unsloth does not import ({type(error).__name__}: {error}){hint}")
    if args.check:
        if moe:
            import transformers
            missing = [name for name in MOE_SHAPES[args.shape]["classes"] if not hasattr(transformers, name)]
            if missing:
                return fail(f"transformers {transformers.__version__} has no {', '.join(missing)}")
        return 0

    import peft
    import transformers
    versions = f"unsloth {unsloth.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    if args.quant == "qlora":
        import bitsandbytes
        versions += f", bitsandbytes {bitsandbytes.__version__}"
    if not moe and not os.path.isfile(os.path.join(path, "config.json")):
        write_checkpoint(path, "--device", "cuda", *([] if layers == LLAMA_LAYERS else ["--layers", str(layers)]))
    checkpointing = "unsloth" if args.checkpointing else False
    torch.manual_seed(0)
    seconds, step, report = [], None, {}
    try:
        start = time.time()
        model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=args.seq,
                                                     dtype=torch.bfloat16, load_in_4bit=args.quant == "qlora",
                                                     use_gradient_checkpointing=checkpointing)
        if moe:
            report.update(quantized_report(model))
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                 target_modules=PROJECTIONS, random_state=0,
                                                 use_gradient_checkpointing=checkpointing)
        FastLanguageModel.for_training(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
        print(f"bench_unsloth: model loaded in {time.time() - start:.1f} s", flush=True)
        if moe:
            report.update(lora_report(model))
            print(f"bench_unsloth: {report['trainable_params']:,} trainable weights; 4-bit "
                  f"{json.dumps(report['quantized_4bit'])}, {report['linear4bit_modules']} Linear4bit; LoRA wrappers "
                  f"{json.dumps(report['lora_wrappers'])}", flush=True)

        vocab = model.config.vocab_size if hasattr(model.config, "vocab_size") else \
            MOE_SHAPES[args.shape]["config"]["vocab_size"]
        input_ids = torch.randint(vocab, (args.micro_batch, args.seq), device="cuda")
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            began = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if step >= args.warmup:
                seconds.append(time.perf_counter() - began)
        if moe:
            try:
                from unsloth_zoo.temporary_patches import moe_utils
                report["moe_backend"] = moe_utils.select_moe_backend()
            except Exception as error:  # noqa: BLE001 (only a note)
                report["moe_backend"] = f"? {type(error).__name__}"
    except torch.cuda.OutOfMemoryError as error:
        where = "while loading" if step is None else f"at step {step}"
        print(f"bench_unsloth: out of memory {where} ({versions})", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(result, oom=f"{where}: " + str(error).split("\n")[0][:200], versions=versions,
                                  **report)))
        return 0
    except Exception as error:  # noqa: BLE001 (the table gets a row either way)
        traceback.print_exc()
        return fail(f"Unsloth failed ({type(error).__name__}: {error})")
    median = statistics.median(seconds)
    tokens_per_second = args.micro_batch * args.seq / median
    peak = torch.cuda.max_memory_allocated()
    depth = "" if layers == full else f" (first {layers} of {full} layers)"
    print(f"bench_unsloth: {args.shape}{depth} {args.quant}, micro-batch {args.micro_batch} x {args.seq}, "
          f"checkpointing {'unsloth' if args.checkpointing else 'off'} ({versions})")
    print(f"  {tokens_per_second:.0f} tokens/s (median of {args.steps} steps, {median:.3f} s each), "
          f"peak memory {peak / 2**30:.2f} GiB")
    if args.json:
        print(json.dumps(dict(result, tokens_per_second=tokens_per_second, peak_memory_bytes=peak,
                              step_seconds=median, versions=versions, **report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
