"""Logits of a Hugging Face model with a PEFT adapter, as PeftModel.from_pretrained gives them.

    python peft_logits.py BASE_DIR ADAPTER_DIR INPUTS.safetensors INPUT_KEY OUT.safetensors

Loads BASE_DIR in fp32 on the CPU, applies ADAPTER_DIR with PeftModel.from_pretrained, runs the
int64 [batch, seq] tensor INPUT_KEY of INPUTS.safetensors through it and writes `logits`
(fp32 [batch, seq, vocab]) to OUT.safetensors. Exits 1 when peft's model and the adapter file
disagree on which LoRA tensors exist or what they hold (a key peft skipped or could not place).
Used by tests/trainer/peft_adapter_test.cpp to check that qtrain's adapters load in peft.
A model whose config soft-caps its attention scores (Gemma 2) runs transformers' eager attention,
the only one that caps them (SDPA leaves them uncapped).
"""
import json
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def attention_for(model_dir):
    """Eager attention where the config soft-caps the scores (SDPA would not cap them)."""
    with open(f"{model_dir}/config.json") as f:
        capped = json.load(f).get("attn_logit_softcapping") is not None
    return {"attn_implementation": "eager"} if capped else {}


def main() -> int:
    base_dir, adapter_dir, inputs_path, input_key, out_path = sys.argv[1:6]
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, **attention_for(base_dir))
    model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()

    saved = load_file(f"{adapter_dir}/adapter_model.safetensors")
    loaded = {name.replace(".default.", "."): tensor for name, tensor in model.named_parameters() if ".lora_" in name}
    # DoRA's magnitude is a DoraLinearLayer's weight in the model, saved without ".weight" (peft's format).
    loaded = {name[:-len(".weight")] if name.endswith("lora_magnitude_vector.weight") else name: tensor
              for name, tensor in loaded.items()}
    if set(saved) != set(loaded):
        print("adapter tensors peft did not place:", sorted(set(saved) - set(loaded))[:5], file=sys.stderr)
        print("LoRA tensors the adapter lacks:", sorted(set(loaded) - set(saved))[:5], file=sys.stderr)
        return 1
    for name, tensor in saved.items():
        if not torch.equal(loaded[name].detach().cpu().to(tensor.dtype), tensor):
            print(f"{name}: peft holds different values than the file", file=sys.stderr)
            return 1

    input_ids = load_file(inputs_path)[input_key]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float().contiguous()
    save_file({"logits": logits}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
