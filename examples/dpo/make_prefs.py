"""Writes the DPO demo's preference pairs: the record-extraction task of the SFT demo, a right and a wrong answer.

Each row is ``{"prompt": [user message], "chosen": [assistant message], "rejected": [assistant message]}``
(TRL's conversational preference format). The prompt is the SFT demo's instruction and a sentence about a
person (``examples/finetune/make_records.py``); ``chosen`` is the correct record line
(``name: X | age: N | city: Y``) and ``rejected`` a plausible wrong one, so which answer is better is
checkable, not a matter of taste. Half the sentences carry a distractor -- a second city or a second
number (a sibling's age, a year, a distance) -- and the wrong answers are of five kinds:

- ``distractor``: the distractor taken for the field (the city they left, the sister's age);
- ``value``: one field slightly wrong (the age off by 1-3, a city not in the sentence);
- ``swapped``: two fields swapped (the city as the name, the name as the city);
- ``format``: the right values in another format (other separators, capitals, field order, a sentence);
- ``missing``: a field left out.

The training pairs use the SFT training set's names and cities; the held-out pairs use names and cities
that occur neither there nor in the SFT held-out set (``records_eval.jsonl``), so a held-out pair is new
to every stage of ``zoo demo``. Each row also says which kind of wrong answer it has (``kind``), for
reading; the trainers ignore extra columns.

    python examples/dpo/make_prefs.py   # rewrites demo/data/prefs_train.jsonl and prefs_eval.jsonl
"""

import importlib.util
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
_spec = importlib.util.spec_from_file_location("make_records", ROOT / "examples" / "finetune" / "make_records.py")
records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(records)

# Neither in the SFT training set nor in its held-out set.
PREF_HELD_OUT_NAMES = "Ayesha Bjorn Camila Dmitri Esther Fabio Gwen Hamid Ilse Joaquin Keiko Lorenzo".split()
PREF_HELD_OUT_CITIES = "Madrid Cork Lagos Geneva Santiago Helsinki Bremen Nantes".split()
assert not set(PREF_HELD_OUT_NAMES) & (set(records.NAMES) | set(records.HELD_OUT_NAMES))
assert not set(PREF_HELD_OUT_CITIES) & (set(records.CITIES) | set(records.HELD_OUT_CITIES))

# {name}, {age}, {city} as in the SFT data; {city2} (another city) and {age2}/{year}/{km} (other numbers) distract.
DISTRACTOR_TEMPLATES = (
    "{name}, {age}, moved from {city2} to {city} last year.",
    "{name} ({age}) lives in {city}; a sibling, {age2}, stayed in {city2}.",
    "At {age}, {name} left {city2} for a new job in {city}.",
    "{name} is {age} and lives in {city}, about {km} km from {city2}.",
    "Since {year}, {name} ({age}) has lived in {city}.",
    "{name}, who is {age}, grew up in {city2} but now lives in {city}.",
    "{name} turned {age} in {city}, where they have lived since the age of {age2}.",
    "Our client {name} ({age}, {city}) was referred by a {age2}-year-old from {city2}.",
)


def record(name, age, city) -> str:
    """The house format the SFT stage teaches."""
    return f"name: {name} | age: {age} | city: {city}"


def _other_age(rng: random.Random, age: int) -> int:
    return age + rng.choice((-3, -2, -1, 1, 2, 3))


def rejected_answer(rng: random.Random, kind: str, f: dict, cities) -> str:
    """A wrong answer of ``kind`` for the facts ``f`` (name, age, city, and the distractors)."""
    name, age, city = f["name"], f["age"], f["city"]
    if kind == "distractor":  # the other city, or the other number as the age
        options = [record(name, age, f["city2"])] if "city2" in f else []
        options += [record(name, f[k], city) for k in ("age2", "year", "km") if k in f]
        return rng.choice(options)
    if kind == "value":
        if rng.random() < 0.5:
            return record(name, _other_age(rng, age), city)
        return record(name, age, rng.choice([c for c in cities if c not in (city, f.get("city2"))]))
    if kind == "swapped":
        return record(city, age, name)
    if kind == "format":
        return rng.choice((
            f"name: {name}, age: {age}, city: {city}",
            f"Name: {name} | Age: {age} | City: {city}",
            f"name: {name} | city: {city} | age: {age}",
            f"{name} | {age} | {city}",
            f"{name} is {age} years old and lives in {city}.",
            f'{{"name": "{name}", "age": {age}, "city": "{city}"}}',
        ))
    if kind == "missing":
        return rng.choice((f"name: {name} | age: {age}", f"name: {name} | city: {city}", f"age: {age} | city: {city}"))
    raise ValueError(kind)


KINDS = ("distractor", "value", "swapped", "format", "missing")
# The kind of the i-th pair's wrong answer: distractors (the hard case) most often; every set has all kinds in
# these proportions (3/8 distractor, 2/8 value, 1/8 each of the others).
CYCLE = ("distractor", "value", "distractor", "format", "distractor", "swapped", "value", "missing")


def pair(rng: random.Random, kind: str, names, cities) -> dict:
    """One preference pair with a wrong answer of ``kind``: a sentence (with a distractor for ``distractor``
    pairs, half the time for the others), its record, and the wrong record."""
    name, city, age = rng.choice(names), rng.choice(cities), rng.randint(19, 88)
    f = {"name": name, "age": age, "city": city}
    if kind == "distractor" or rng.random() < 0.5:
        template = rng.choice(DISTRACTOR_TEMPLATES)
        extra = {"city2": rng.choice([c for c in cities if c != city]),
                 "age2": rng.choice([a for a in range(12, 90) if abs(a - age) > 3]),
                 "year": rng.randint(1990, 2023), "km": rng.randint(20, 900)}
        f.update({k: v for k, v in extra.items() if "{" + k + "}" in template})
        sentence = template.format(**f)
    else:
        sentence = rng.choice(records.TEMPLATES).format(**f)
    wrong = rejected_answer(rng, kind, f, cities)
    assert wrong != record(name, age, city)
    return {"prompt": [{"role": "user", "content": records.INSTRUCTION + sentence}],
            "chosen": [{"role": "assistant", "content": record(name, age, city)}],
            "rejected": [{"role": "assistant", "content": wrong}],
            "kind": kind}


def main() -> None:
    """Write 256 training and 48 held-out preference pairs into demo/data/ (deterministic)."""
    rng = random.Random(1)
    here = ROOT / "demo" / "data"
    for fname, n, names, cities in (("prefs_train.jsonl", 256, records.NAMES, records.CITIES),
                                    ("prefs_eval.jsonl", 48, PREF_HELD_OUT_NAMES, PREF_HELD_OUT_CITIES)):
        with open(here / fname, "w") as f:
            for i in range(n):
                f.write(json.dumps(pair(rng, CYCLE[i % len(CYCLE)], names, cities)) + "\n")


if __name__ == "__main__":
    main()
