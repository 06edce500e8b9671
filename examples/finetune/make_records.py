"""Writes the fine-tuning demo's data: sentences about a person -> one record line in a house format.

The answer format (``name: X | age: N | city: Y``) is not stated in the prompt, so the base
model cannot guess it; a few minutes of LoRA teach it. The held-out set uses names and cities
that never appear in training, so a right answer means the format was learned, not memorized.

    python examples/finetune/make_records.py   # rewrites demo/data/records_train.jsonl and records_eval.jsonl
"""

import json
import random
from pathlib import Path

NAMES = ("Maria Lucas Aisha Tomas Elena Hiro Fatima Jonas Sofia Mateo Ingrid Ravi Chloe Omar Lena Pablo Yuki Noah "
         "Amara Felix Nadia Victor Greta Samir Clara Diego Hannah Ivan Leila Marco Nora Erik Zara Felipe Alma Kofi "
         "Rosa Anton Mei Jakob Selin Bruno Olga Tariq Vera Liam Ines Arjun Freya Hugo").split()
HELD_OUT_NAMES = "Beatriz Kenji Astrid Emeka Livia Sergei Nia Oskar Priya Dante Wanda Idris".split()
CITIES = ("Lisbon Oslo Nairobi Lima Kyoto Dublin Cairo Quito Prague Hanoi Porto Dakar Bergen Austin Leeds Tunis "
          "Krakow Seville Denver Munich Osaka Accra Turin Zurich Malmo Perth Cusco Split").split()
HELD_OUT_CITIES = "Lyon Ghent Bogota Tallinn Mumbai Boston Riga Rabat".split()
TEMPLATES = (
    "{name} is {age} years old and lives in {city}.",
    "Born {age} years ago, {name} now calls {city} home.",
    "{name}, aged {age}, moved to {city} last spring.",
    "In {city} you will find {name}, who turned {age} this year.",
    "At {age}, {name} runs a small bakery in {city}.",
    "{name} ({age}) has lived in {city} for a decade.",
    "Our new colleague {name} is {age} and commutes from {city}.",
    "{city} is where {name}, {age}, grew up.",
)
INSTRUCTION = "Extract the record from this sentence:\n"


def example(rng: random.Random, names, cities) -> dict:
    """One conversation: a sentence, and its record as the answer."""
    name, city, age = rng.choice(names), rng.choice(cities), rng.randint(19, 88)
    sentence = rng.choice(TEMPLATES).format(name=name, age=age, city=city)
    return {"messages": [{"role": "user", "content": INSTRUCTION + sentence},
                         {"role": "assistant", "content": f"name: {name} | age: {age} | city: {city}"}]}


def main() -> None:
    """Write 320 training and 48 held-out conversations into demo/data/ (deterministic)."""
    rng = random.Random(0)
    here = Path(__file__).resolve().parent.parent.parent / "demo" / "data"
    for fname, n, names, cities in (("records_train.jsonl", 320, NAMES, CITIES),
                                    ("records_eval.jsonl", 48, HELD_OUT_NAMES, HELD_OUT_CITIES)):
        with open(here / fname, "w") as f:
            for _ in range(n):
                f.write(json.dumps(example(rng, names, cities)) + "\n")


if __name__ == "__main__":
    main()
