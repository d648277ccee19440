"""Preference pairs for recipes/demo_dpo_tiny.yaml, made from the bundled chats.

    python3 tools/make_demo_pairs.py

For each chat of recipes/demo/chat-{train,val}.jsonl: the prompt is its system and user turns,
`chosen` the assistant's true next sentence, `rejected` the same sentence with its words in a
shuffled order (seeded). Writes recipes/demo/pairs-{train,val}.jsonl in TRL's conversational
preference form: {"prompt": [messages], "chosen": [message], "rejected": [message]}.
"""
import json
import os
import random

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "demo")


def shuffled(sentence, rng):
    words = sentence.split()
    for _ in range(10):
        rng.shuffle(words)
        if " ".join(words) != sentence:
            break
    return " ".join(words)


def main():
    rng = random.Random(0)
    for split in ("train", "val"):
        pairs = []
        with open(os.path.join(DEMO, f"chat-{split}.jsonl")) as f:
            for line in f:
                messages = json.loads(line)["messages"]
                answer = messages[-1]["content"]
                if len(answer.split()) < 3:
                    continue
                pairs.append({"prompt": messages[:-1],
                              "chosen": [{"role": "assistant", "content": answer}],
                              "rejected": [{"role": "assistant", "content": shuffled(answer, rng)}]})
        with open(os.path.join(DEMO, f"pairs-{split}.jsonl"), "w") as f:
            for pair in pairs:
                f.write(json.dumps(pair) + "\n")
        print(f"pairs-{split}.jsonl: {len(pairs)} pairs")


if __name__ == "__main__":
    main()
