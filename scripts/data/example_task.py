"""A multiple-choice task over the example corpus' grammar, in HellaSwag's layout; no download.

    .venv/bin/python scripts/data/example_task.py [OUT=runs/example/task.jsonl] [N=200]

Each example is a story's opening in scripts/data/example_corpus.py's grammar, up to its closing
sentence "The end of the story of"; the right ending names the story's own person and animal
("Ada and the cat."), the three others another person, another animal or both. A model that
learned the corpus copies them from the context: accuracy rises from chance (0.25) as it trains.
Seeded (its own seed, not the corpus'), so every machine writes the same file. For docs/eval.md.
"""
import json
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "runs/example/task.jsonl"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
rng = random.Random(62)
names = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana"]
animals = ["cat", "dog", "fox", "owl", "hen", "frog"]
places = ["the garden", "the river", "the old mill", "the market", "the hill", "the forest"]
verbs = ["found", "followed", "fed", "painted", "lost", "watched"]

with open(out, "w") as f:
    for i in range(n):
        who, pet = rng.choice(names), rng.choice(animals)
        other_who = rng.choice([x for x in names if x != who])
        other_pet = rng.choice([x for x in animals if x != pet])
        ctx = (f"{who} had a {pet} that lived near {rng.choice(places)}. "
               f"One day {who} {rng.choice(verbs)} the {pet} at {rng.choice(places)}. "
               f"The end of the story of")
        wrong = [f"{other_who} and the {pet}.", f"{who} and the {other_pet}.", f"{other_who} and the {other_pet}."]
        label = rng.randrange(4)
        endings = wrong[:label] + [f"{who} and the {pet}."] + wrong[label:]
        f.write(json.dumps({"ind": i, "ctx": ctx, "endings": endings, "label": label}) + "\n")
print(f"wrote {n} examples to {out}")
