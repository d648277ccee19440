"""transformers' rendering of a chat template, for tests/data/chat_template_test.cpp.

    python render_chat_template.py TOKENIZER_DIR REQUEST.json OUT.json
        REQUEST: {"template": PATH, "cases": [{"messages": [...], "add_generation_prompt": bool}, ...]}
        Loads TOKENIZER_DIR with AutoTokenizer (its bos / eos tokens fill the template's), renders
        each case with apply_chat_template(tokenize=False) and the template's text, and writes
        {"texts": [...], "ids": [[...], ...]} (ids: the text tokenized without adding special
        tokens, as a trainer tokenizes a rendered conversation). A case the template refuses
        (raise_exception) renders as null.
"""
import json
import sys


def main() -> int:
    from transformers import AutoTokenizer

    tokenizer_dir, request_path, out_path = sys.argv[1:4]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with open(request_path, encoding="utf-8") as file:
        request = json.load(file)
    with open(request["template"], encoding="utf-8") as file:
        template = file.read()
    texts, ids = [], []
    for case in request["cases"]:
        try:
            text = tokenizer.apply_chat_template(case["messages"], chat_template=template, tokenize=False,
                                                 add_generation_prompt=case["add_generation_prompt"])
        except Exception as error:  # the template's raise_exception
            if "TemplateError" not in type(error).__name__:
                raise
            texts.append(None)
            ids.append(None)
            continue
        texts.append(text)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    with open(out_path, "w", encoding="utf-8") as file:
        json.dump({"texts": texts, "ids": ids}, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
