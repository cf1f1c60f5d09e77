"""A small example corpus and tokenizer for the README walkthrough; no download.

    .venv/bin/python scripts/data/example_corpus.py [OUT=runs/example]

Writes OUT/corpus/stories.txt (documents separated by blank lines) and OUT/corpus/notes.jsonl
({"text": ...} per line): short generated stories from a fixed grammar (seeded, so every
machine gets the same corpus, about 2 MB), and OUT/tokenizer.json: a byte-level BPE of at most
512 tokens (the grammar's words run out of merges at 424) with <|endoftext|>, trained on that corpus with the `tokenizers` package.
"""
import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = sys.argv[1] if len(sys.argv) > 1 else "runs/example"
os.makedirs(f"{out}/corpus", exist_ok=True)
rng = random.Random(14)
names = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana"]
animals = ["cat", "dog", "fox", "owl", "hen", "frog"]
places = ["the garden", "the river", "the old mill", "the market", "the hill", "the forest"]
verbs = ["found", "followed", "fed", "painted", "lost", "watched"]
feelings = ["happy", "tired", "curious", "hungry", "brave", "sleepy"]


def story():
    who, pet, where = rng.choice(names), rng.choice(animals), rng.choice(places)
    lines = [f"{who} had a {pet} that lived near {where}."]
    for _ in range(rng.randint(2, 5)):
        lines.append(
            rng.choice([
                f"One day {who} {rng.choice(verbs)} the {pet} at {rng.choice(places)}.",
                f"The {pet} was {rng.choice(feelings)}, so {who} gave it some bread.",
                f"{who} and the {pet} walked to {rng.choice(places)} and back.",
                f"In the evening the {pet} slept and {who} was {rng.choice(feelings)}.",
            ])
        )
    lines.append(f"The end of the story of {who} and the {pet}.")
    return " ".join(lines)


with open(f"{out}/corpus/stories.txt", "w") as f:
    f.write("\n\n".join(story() for _ in range(6000)) + "\n")
with open(f"{out}/corpus/notes.jsonl", "w") as f:
    for _ in range(2000):
        f.write(json.dumps({"id": rng.randint(0, 10**6), "text": story()}) + "\n")

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
)
tok.train([f"{out}/corpus/stories.txt"], trainer)
tok.save(f"{out}/tokenizer.json")
print(f"wrote {out}/corpus/stories.txt, {out}/corpus/notes.jsonl and {out}/tokenizer.json (vocabulary {tok.get_vocab_size()})")
