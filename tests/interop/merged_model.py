"""What transformers and peft make of a merged model, for tests/trainer/merged_export_test.cpp.

    python merged_model.py logits MODEL_DIR INPUTS.safetensors INPUT_KEY OUT.safetensors
        AutoModelForCausalLM.from_pretrained(MODEL_DIR) in fp32 on the CPU; writes `logits`
        (fp32 [batch, seq, vocab]) for the int64 [batch, seq] tensor INPUT_KEY of INPUTS.
        Exits 1 when transformers reports weights it did not find or did not use.
    python merged_model.py peft-merge BASE_DIR ADAPTER_DIR OUT.safetensors
        PeftModel.from_pretrained(BASE_DIR in fp32, ADAPTER_DIR).merge_and_unload(); writes its
        state dict (fp32) under the Hugging Face names.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from peft_logits import attention_for
from script_modes import run_mode


def logits(model_dir: str, inputs_path: str, input_key: str, out_path: str) -> int:
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True,
                                                       **attention_for(model_dir))
    problems = {key: value for key, value in info.items() if value}
    if problems:
        print(f"transformers loaded {model_dir} with problems: {problems}", file=sys.stderr)
        return 1
    model.eval()
    input_ids = load_file(inputs_path)[input_key]
    with torch.no_grad():
        result = model(input_ids=input_ids).logits.float().contiguous()
    save_file({"logits": result}, out_path)
    return 0


def peft_merge(base_dir: str, adapter_dir: str, out_path: str) -> int:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    state = {name: tensor.detach().float().contiguous() for name, tensor in merged.state_dict().items()}
    save_file(state, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(run_mode({"logits": logits, "peft-merge": peft_merge}))
