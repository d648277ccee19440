#!/usr/bin/env python3
"""The Unsloth anchor of `qtrain bench`: the same training step in Unsloth, same shape and settings,
so that the two can be compared on one GPU (tools/bench.sh).

Unsloth loads from disk, so the first run writes the random Llama-3-8B-shaped bf16 checkpoint of
tools/random_checkpoint.py, with a tokenizer of its 128,256 ids, into $QTRAIN_BENCH_CHECKPOINT
(default /tmp/qtrain-bench-llama3-8b, about 16 GB) and later runs reuse it. Unsloth's own
recipe: FastLanguageModel.from_pretrained (load_in_4bit for QLoRA, NF4), get_peft_model with LoRA
r16 alpha 32 dropout 0 on the 7 projections, its default use_gradient_checkpointing="unsloth"
(which offloads activations to the host) with --checkpointing and False without; then a plain
loop on random token ids: forward with labels under bf16 autocast, backward, clipping at 1, torch
AdamW lr 1e-4 on the LoRA weights. Prints the median step's tokens/s and the peak allocated memory
of the timed steps (reset after warm-up, as qtrain bench does), and with --json one JSON object
(with "oom" on running out of memory, "error" where it could not run).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

from bench_arguments import add_row_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = os.path.abspath(os.environ.get("QTRAIN_BENCH_CHECKPOINT", "/tmp/qtrain-bench-llama3-8b"))
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    parser.add_argument("--shape", default="llama3-8b", help="llama3-8b only (the checkpoint on disk)")
    add_row_arguments(parser)
    parser.add_argument("--check", action="store_true",
                        help="only test that this can run: the shape, a GPU, `import unsloth` (exit 0 if so)")
    args = parser.parse_args()
    result = dict(shape=args.shape, quant=args.quant, micro_batch=args.micro_batch, seq=args.seq,
                  checkpointing=args.checkpointing)

    def fail(message):
        print(f"bench_unsloth: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(result, error=message)))
        return 1

    if args.shape != "llama3-8b":
        return fail(f"--shape {args.shape}: only llama3-8b is benchmarked here (Unsloth loads the random "
                    "Llama-3-8B-shaped checkpoint of tools/random_checkpoint.py from disk)")
    import torch
    if not torch.cuda.is_available():
        return fail("no CUDA GPU: Unsloth's training step runs on an NVIDIA GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
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
        return 0

    import peft
    import transformers
    versions = f"unsloth {unsloth.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    if args.quant == "qlora":
        import bitsandbytes
        versions += f", bitsandbytes {bitsandbytes.__version__}"
    if not os.path.isfile(os.path.join(CHECKPOINT, "config.json")):
        write_checkpoint(CHECKPOINT, "--device", "cuda")
    checkpointing = "unsloth" if args.checkpointing else False
    torch.manual_seed(0)
    seconds, step = [], None
    try:
        start = time.time()
        model, _ = FastLanguageModel.from_pretrained(model_name=CHECKPOINT, max_seq_length=args.seq,
                                                     dtype=torch.bfloat16, load_in_4bit=args.quant == "qlora",
                                                     use_gradient_checkpointing=checkpointing)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                 target_modules=PROJECTIONS, random_state=0,
                                                 use_gradient_checkpointing=checkpointing)
        FastLanguageModel.for_training(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
        print(f"bench_unsloth: model loaded in {time.time() - start:.1f} s", flush=True)

        input_ids = torch.randint(model.config.vocab_size, (args.micro_batch, args.seq), device="cuda")
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
    except torch.cuda.OutOfMemoryError as error:
        where = "while loading" if step is None else f"at step {step}"
        print(f"bench_unsloth: out of memory {where} ({versions})", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(result, oom=f"{where}: " + str(error).split("\n")[0][:200], versions=versions)))
        return 0
    except Exception as error:  # noqa: BLE001 (the table gets a row either way)
        traceback.print_exc()
        return fail(f"Unsloth failed ({type(error).__name__}: {error})")
    median = statistics.median(seconds)
    tokens_per_second = args.micro_batch * args.seq / median
    peak = torch.cuda.max_memory_allocated()
    print(f"bench_unsloth: {args.shape} {args.quant}, micro-batch {args.micro_batch} x {args.seq}, checkpointing "
          f"{'unsloth' if args.checkpointing else 'off'} ({versions})")
    print(f"  {tokens_per_second:.0f} tokens/s (median of {args.steps} steps, {median:.3f} s each), "
          f"peak memory {peak / 2**30:.2f} GiB")
    if args.json:
        print(json.dumps(dict(result, tokens_per_second=tokens_per_second, peak_memory_bytes=peak,
                              step_seconds=median, versions=versions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
