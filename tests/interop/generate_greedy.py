"""transformers' greedy generation, for tests/trainer/generation_interop_test.cpp.

    python generate_greedy.py MODEL_DIR PROMPTS.json MAX_NEW_TOKENS DEVICE OUT.json [ADAPTER_DIR]

Loads MODEL_DIR in fp32 on DEVICE (cpu or cuda) and for each prompt (a list of token ids) in
PROMPTS.json takes the new tokens of generate(do_sample=False, max_new_tokens=MAX_NEW_TOKENS),
which stops, as generate does, at the generation config's eos_token_id. Writes
{"base": [ids per prompt]} to OUT.json, and with ADAPTER_DIR also "adapter": the same with the
PEFT adapter applied (PeftModel.from_pretrained).
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def greedy(model, prompts, max_new_tokens, device):
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids], device=device)
        with torch.no_grad():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
        outputs.append(generated[0, len(ids):].tolist())
    return outputs


def main() -> int:
    model_dir, prompts_path, max_new_tokens, device, out_path = sys.argv[1:6]
    adapter_dir = sys.argv[6] if len(sys.argv) > 6 else None
    with open(prompts_path) as file:
        prompts = json.load(file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    result = {"base": greedy(model, prompts, int(max_new_tokens), device)}
    if adapter_dir:
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(model, adapter_dir).to(device).eval()
        result["adapter"] = greedy(adapted, prompts, int(max_new_tokens), device)
    with open(out_path, "w") as file:
        json.dump(result, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
