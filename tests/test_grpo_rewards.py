"""GRPO's rewards: the shipped verifiers (grpo/verifiers.py) on hand-written completions, loading grpo.rewards
specs (grpo/rewards.py) and every error a user can meet, and the weighted total as TRL computes it."""

import math
import sys

import numpy as np
import pytest

from grpo import verifiers
from grpo.rewards import RewardFunction, RewardSet, load_rewards
from grpo.verifiers import exact_match, final_number, length_penalty
from zoo.errors import UserError


def chat(text):
    """A conversational completion (TRL's shape): one assistant message."""
    return [{"role": "assistant", "content": text}]


def score(fn, completions, ids=None, **kwargs):
    """Call a reward function TRL's way: by keyword, prompts and ids of the right length."""
    ids = ids if ids is not None else [[0]] * len(completions)
    return fn(prompts=["q"] * len(completions), completions=completions, completion_ids=ids, **kwargs)


def where(i):
    return f"data/train.jsonl, line {i + 3}"


# ------------------------------------------------------------------------------------------------- exact_match

def test_exact_match_strips_and_compares_str_of_the_answer():
    completions = ["  Paris\n", "paris", "Paris.", "7", "7", "x"]
    answers = ["Paris", "Paris", "Paris", 7, " 7 ", None]
    assert score(exact_match, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0, None]


def test_exact_match_ignore_case_conversational_and_several_answers():
    completions = [chat("PARIS"), [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " Rome "}],
                   chat("Lyon"), chat(None)]
    answers = ["paris", "rome", ["Paris", "lyon"], "x"]
    assert score(exact_match, completions, answer=answers) == [0.0, 0.0, 0.0, 0.0]
    assert score(exact_match, completions, answer=answers, ignore_case=True) == [1.0, 1.0, 1.0, 0.0]


def test_exact_match_without_an_answer_column_does_not_apply():
    assert score(exact_match, ["a", "b"]) == [None, None]
    assert score(exact_match, ["a"], other=["a"]) == [None]  # other columns are ignored


def test_answer_field_names_the_answers_column():
    """exact_match and final_number read their answers from the column answer_field names (default: answer), and
    the set of rewards says which column each shipped verifier needs: a missing one is a UserError naming it, the
    rows' columns and the option; a user's function is not checked (its columns are its own)."""
    assert score(exact_match, ["x", "y"], answer=["y", "y"], answer_field="target", target=["x", "z"]) == [1.0, 0.0]
    assert score(final_number, ["is 4", "is 5"], answer_field="target", target=["4", "4"]) == [1.0, 0.0]
    rs = load_rewards([{"function": "exact_match", "answer_field": "target"}, "final_number", lambda **_: [0.0]])
    rs.check_columns(["answer", "target"], "data.path d.jsonl")
    with pytest.raises(UserError, match="data.path d.jsonl: reward function final_number needs the column 'answer' "
                                        r".* besides the prompt are target; .*\{function: final_number, "
                                        r"answer_field: target\}"):
        rs.check_columns(["target"], "data.path d.jsonl")
    with pytest.raises(UserError, match="reward function exact_match needs the column 'target' .* are answer, x; "
                                        r".*answer_field: COLUMN\}"):
        rs.check_columns(["answer", "x"], "data.path d.jsonl")
    load_rewards([lambda **_: [0.0]]).check_columns([], "data.path d.jsonl")
    with pytest.raises(UserError, match="answer_field must be a data column's name, got 3"):
        load_rewards([{"function": "exact_match", "answer_field": 3}])


# ------------------------------------------------------------------------------------------------ final_number

@pytest.mark.parametrize("text, answer, reward", [
    ("The answer is 1,234.", "1234", 1.0),
    ("so 1234", "1,234", 1.0),                         # separators in the answer too
    ("1,234,567 apples", 1234567, 1.0),
    ("it drops to -5", -5, 1.0),
    ("it drops to -5", 5, 0.0),
    ("from 3-5 we get", 5, 1.0),                        # '3-5': a minus between terms, not a sign
    ("pi is about 3.14, so 3.50", 3.5, 1.0),            # the last number wins
    ("first 12 then 13", 12, 0.0),
    ("-0.25", "-0.25", 1.0),
    ("x = \u22127", -7, 1.0),                            # the Unicode minus sign
    ("\\boxed{42} but then I rambled about 7", 42, 1.0),   # \boxed{} takes precedence over the last number
    ("\\boxed{42} but then I rambled about 7", 7, 0.0),
    ("so \\boxed{\\frac{3}{4}}", 0.75, 1.0),
    ("so \\boxed{-\\dfrac{1}{2}}", -0.5, 1.0),
    ("\\boxed{1{,}000} dollars", 1000, 1.0),
    ("\\boxed{x+1}", 1, 1.0),                            # the number inside the box
    ("\\boxed{y} 5", 5, 0.0),                           # a box without a number: no answer, whatever follows
    ("答案是42", 42, 1.0),
    ("see step2", 2, 0.0),                              # digits glued to a word are not a number
    ("no number at all", 3, 0.0),
    ("", 0, 0.0),
])
def test_final_number(text, answer, reward):
    assert score(final_number, [text], answer=[answer]) == [reward]
    assert score(final_number, [chat(text)], answer=[answer]) == [reward]


def test_final_number_tolerance_is_relative_above_one_absolute_below():
    # |x - a| <= tolerance * max(1, |a|), with binary-exact numbers so the edges are exact
    texts = ["3", "3.25", "0.75", "0.875", "-1", "6", "6.5"]
    answers = [2, 2, 0.25, 0.25, -2, 4, 4]
    # a=2: bound 0.5*2=1 (3 in, 3.25 out); a=0.25: bound 0.5*1 (0.75 in, 0.875 out); a=-2: bound 1 (-1 in);
    # a=4: bound 2 (6 in, 6.5 out)
    assert score(final_number, texts, answer=answers, tolerance=0.5) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert score(final_number, ["0.30000001", "0.3001"], answer=[0.3, 0.3]) == [1.0, 0.0]  # default 1e-6


def test_final_number_does_not_apply_without_a_numeric_answer():
    answers = [None, "seventy", "#### 72", math.nan, True]
    assert score(final_number, ["72"] * 5, answer=answers) == [None] * 5
    assert score(final_number, ["72"]) == [None]


def test_final_number_bad_tolerance():
    with pytest.raises(UserError, match="tolerance"):
        score(final_number, ["1"], answer=[1], tolerance=-1)


# ----------------------------------------------------------------------------------------------------- format

def test_format_fullmatch_over_lines_and_search():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    completions = ["\n<think>a\nb</think>\n<answer>4</answer>  \n", "<think>a</think> 4",
                   "intro <think>x</think><answer>1</answer>", chat("<think></think><answer>2</answer>")]
    assert score(verifiers.format, completions, pattern=pattern) == [1.0, 0.0, 0.0, 1.0]
    assert score(verifiers.format, completions, pattern=pattern, mode="search") == [1.0, 0.0, 1.0, 1.0]


def test_format_errors_name_the_pattern():
    with pytest.raises(UserError, match="needs a pattern"):
        score(verifiers.format, ["x"])
    with pytest.raises(UserError, match=r"pattern '<a\(' is not a valid regular expression"):
        score(verifiers.format, ["x"], pattern="<a(")
    with pytest.raises(UserError, match="mode must be one of fullmatch, search"):
        score(verifiers.format, ["x"], pattern="x", mode="match")


# --------------------------------------------------------------------------------------------- length_penalty

def test_length_penalty_follows_dapo_eq_13():
    # max_length 20, cache 5: 0 up to 15 tokens, then (15 - L) / 5 down to -1 at 20, -1 beyond
    lengths = [0, 10, 15, 16, 18, 20, 21, 100]
    ids = [[7] * n for n in lengths]
    got = score(length_penalty, [""] * len(ids), ids, max_length=20, cache=5)
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0], abs=1e-12)


def test_length_penalty_default_cache_and_hard_cut():
    ids = [[1] * n for n in (12, 13, 14, 16, 17)]
    # max_length 16: cache 16 // 4 = 4, soft limit 12
    assert score(length_penalty, [""] * 5, ids, max_length=16) == pytest.approx([0.0, -0.25, -0.5, -1.0, -1.0])
    # cache 0: no slope, only the cut at max_length
    assert score(length_penalty, [""] * 5, ids, max_length=16, cache=0) == [0.0, 0.0, 0.0, 0.0, -1.0]


def test_length_penalty_needs_max_length():
    with pytest.raises(UserError, match="needs max_length"):
        score(length_penalty, ["x"])
    with pytest.raises(UserError, match="cache must be a whole number of tokens from 0 to max_length=8"):
        score(length_penalty, ["x"], max_length=8, cache=9)


# ----------------------------------------------------------------------------------------------------- loading

USER_REWARDS = '''
from dataclasses import dataclass


@dataclass
class Scale:  # a dataclass needs its module in sys.modules: the file must be registered there
    k: float


def count_a(prompts, completions, completion_ids, **kwargs):
    return [float(c.count("a")) for c in completions]


def scaled(prompts, completions, completion_ids, factor=1.0, **kwargs):
    return [Scale(factor).k * len(c) for c in completions]


def strict(completions, answer):  # no **kwargs: it gets only what it names
    return [float(c == a) for c, a in zip(completions, answer)]


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module in a tmp folder on sys.path, imported by name (forgotten again afterwards)."""
    (tmp_path / "my_rewards_mod.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_load_shipped_names_with_default_weights():
    rs = load_rewards(["exact_match", "final_number"])
    assert rs.names == ["exact_match", "final_number"]
    assert [f.fn for f in rs.functions] == [verifiers.exact_match, verifiers.final_number]
    assert rs.weights.tolist() == [1.0, 1.0]


def test_load_module_function(user_module):
    rs = load_rewards([f"{user_module}:count_a"], [2])
    assert rs.names == ["count_a"]
    per, total = rs.compute(["p", "p"], ["banana", "kiwi"], [[1], [2]], {}, where)
    assert per.tolist() == [[3.0], [0.0]]
    assert total.tolist() == [6.0, 0.0]


def test_load_file_function_relative_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "custom.py").write_text(USER_REWARDS)
    monkeypatch.chdir(tmp_path)
    rs = load_rewards(["rw/custom.py:scaled", {"function": "rw/custom.py:scaled", "factor": 0.5, "name": "half"}])
    assert rs.names == ["scaled", "half"]
    assert rs.functions[0].fn is rs.functions[1].fn  # one file, loaded once
    assert rs.functions[0].fn.__module__ != "custom"  # under a name of its own, shadowing nothing
    per, _ = rs.compute(["p"], ["abcd"], [[1]], {}, where)
    assert per.tolist() == [[4.0, 2.0]]


def test_load_mapping_name_kwargs_and_duplicate_names():
    rs = load_rewards([{"function": "format", "pattern": "a+", "name": "fmt"},
                       {"function": "final_number", "tolerance": 0.1},
                       "final_number", "final_number"], [1, 2, 3, 4])
    assert rs.names == ["fmt", "final_number", "final_number_2", "final_number_3"]
    assert rs.functions[0].kwargs == {"pattern": "a+"}
    assert rs.functions[1].kwargs == {"tolerance": 0.1}
    assert rs.weights.tolist() == [1.0, 2.0, 3.0, 4.0]
    per, _ = rs.compute(["p"], ["aaa 1.05"], [[1]], {"answer": [1]}, where)
    assert per.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # tolerance 0.1 reaches 1.05 only in the mapping's function


def test_function_without_kwargs_gets_only_the_columns_it_names(user_module):
    rs = load_rewards([f"{user_module}:strict"])
    per, _ = rs.compute(["p", "p"], ["x", "y"], [[1], [2]], {"answer": ["x", "z"], "topic": ["a", "b"]}, where)
    assert per.tolist() == [[1.0], [0.0]]


@pytest.mark.parametrize("spec, message", [
    ("exactmatch", "grpo.rewards entry 'exactmatch': no shipped reward function 'exactmatch' \\(shipped: "
                   "exact_match, final_number, format, length_penalty\\)"),
    ("my_pkg.score", "separate them with a colon: my_pkg:score"),
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz' can be imported"),
    ("no_such_module_xyz.sub:f", "no module named 'no_such_module_xyz.sub' can be imported"),
    ("missing/rewards.py:f", "missing/rewards.py does not exist \\(relative paths start at the current directory"),
    ("math:no_such_fn", "'math:no_such_fn': math has no function 'no_such_fn'"),
    ("math:pi", "math's pi is not a function \\(got float\\)"),
    ("math:", "both sides of the colon"),
    ({"pattern": "x"}, "has no 'function' key"),
    ({"exact_match": {"ignore_case": True}}, "write \\{function: exact_match, ignore_case: True\\}"),
    (42, "grpo.rewards entry 42 is not a function \\(got int\\); give one"),
    (["exact_match"], "\\(got list\\)"),
    ({"function": 3}, "'function' must be a string"),
    ({"function": "final_number", "name": ""}, "'name' must be a non-empty string"),
    ({"function": "exact_match", "ignorecase": True}, "the exact_match reward has no option 'ignorecase'; its options: "
                                                      "ignore_case"),
    ({"function": "final_number", "tolerance": "big"}, "tolerance must be a number"),
    ("format", "the format reward needs a pattern"),  # caught at load, not at step 1
    ({"function": "format", "pattern": "(unclosed"}, "pattern '\\(unclosed' is not a valid regular expression"),
    ("length_penalty", "needs max_length"),
    ({"function": "length_penalty", "max_length": 0}, "max_length must be a whole number of tokens >= 1"),
    ({"function": "exact_match", "completions": 1}, "'completions' is an argument the trainer passes"),
])
def test_load_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        load_rewards([spec])
    assert "\n" not in str(e.value)


def test_load_errors_in_user_code(tmp_path, monkeypatch, user_module):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    with pytest.raises(UserError, match="loading broken.py failed: ModuleNotFoundError: No module named "
                                        "'not_installed_dep_xyz'"):
        load_rewards(["broken.py:f"])
    with pytest.raises(UserError, match="loading syntax.py failed: SyntaxError"):
        load_rewards(["syntax.py:f"])
    with pytest.raises(UserError, match="its functions: .*count_a"):
        load_rewards([f"{user_module}:nope"])
    with pytest.raises(UserError, match="strict takes no argument 'factor'"):
        load_rewards([{"function": f"{user_module}:strict", "factor": 2}])
    with pytest.raises(UserError, match="a folder, not a file"):
        (tmp_path / "d.py").mkdir()
        load_rewards(["d.py:f"])
    assert not any(m.startswith("_zoo_rewards_broken") for m in sys.modules)  # a failed load leaves nothing


def test_weights_must_match_the_functions():
    with pytest.raises(UserError, match="2 weights for 1 reward functions"):
        load_rewards(["exact_match"], [1, 2])
    with pytest.raises(UserError, match="must be numbers"):
        load_rewards(["exact_match"], ["heavy"])
    with pytest.raises(UserError, match="grpo.rewards is empty"):
        load_rewards([])


# --------------------------------------------------------------------------------------------------- combining

def fixed(values):
    """A reward function returning ``values`` whatever it is given."""
    def fn(prompts, completions, completion_ids, **kwargs):
        return list(values)
    return fn


def test_compute_weights_none_and_the_nansum():
    rs = RewardSet([RewardFunction("a", fixed([1.0, None, None, 0.5])),
                    RewardFunction("b", fixed([2.0, 3.0, None, True]))], [0.5, 2.0])
    per, total = rs.compute(["p"] * 4, ["c"] * 4, [[1]] * 4, {}, where)
    assert per.dtype == np.float64 and per.shape == (4, 2)
    np.testing.assert_array_equal(per, [[1.0, 2.0], [np.nan, 3.0], [np.nan, np.nan], [0.5, 1.0]])
    # 0.5*1 + 2*2; the None left out; a row where nothing applies: 0; True is 1.0
    assert total.dtype == np.float64
    assert total.tolist() == [4.5, 6.0, 0.0, 2.25]


def test_compute_passes_columns_and_config_kwargs_once_per_batch():
    calls = []

    def spy(prompts, completions, completion_ids, **kwargs):
        calls.append((list(prompts), list(completions), [list(i) for i in completion_ids], kwargs))
        return np.array([0.25, 1])  # a numpy vector is fine too

    rs = RewardSet([RewardFunction("spy", spy, {"level": 3})])
    per, total = rs.compute(["p1", "p2"], [chat("x"), chat("y")], [[1, 2], [3]], {"answer": [1, 2]}, where)
    assert calls == [(["p1", "p2"], [chat("x"), chat("y")], [[1, 2], [3]], {"answer": [1, 2], "level": 3})]
    assert per.tolist() == [[0.25], [1.0]] and total.tolist() == [0.25, 1.0]


def test_shipped_verifiers_together():
    rs = load_rewards(["final_number", {"function": "format", "pattern": r".*\\boxed\{.*\}"},
                       {"function": "length_penalty", "max_length": 8, "cache": 4}], [1.0, 0.5, 1.0])
    completions = ["so \\boxed{12}", "I think 12", "\\boxed{13}"]
    ids = [[1] * 3, [1] * 6, [1] * 9]
    per, total = rs.compute(["q"] * 3, completions, ids, {"answer": ["12", "12", None]}, where)
    np.testing.assert_allclose(per, [[1, 1, 0], [1, 0, -0.5], [np.nan, 1, -1]])
    np.testing.assert_allclose(total, [1.5, 0.5, -0.5])


def test_a_reward_that_raises_names_the_row():
    def picky(prompts, completions, completion_ids, answer, **kwargs):
        return [1.0 / len(a) for a in answer]  # an empty answer divides by zero

    rs = RewardSet([RewardFunction("ok", fixed([1, 1, 1, 1])), RewardFunction("picky", picky)])
    with pytest.raises(UserError) as e:
        rs.compute(["p"] * 4, ["c"] * 4, [[1]] * 4, {"answer": ["ab", "c", "", ""]}, where)
    # the first row that fails alone is the third: where(2)
    assert str(e.value) == ("reward function picky raised ZeroDivisionError: float division by zero on "
                            "data/train.jsonl, line 5")
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_reward_that_fails_only_on_the_whole_batch():
    def needs_groups(prompts, completions, completion_ids, **kwargs):
        if len(completions) % 2:
            return [0.0] * len(completions)
        raise RuntimeError("groups\nof two")

    rs = RewardSet([RewardFunction("grp", needs_groups)])
    with pytest.raises(UserError, match=r"^reward function grp raised RuntimeError: groups of two on the batch of 2 "
                                        r"completions \(each completion alone scores\)$"):
        rs.compute(["p"] * 2, ["c"] * 2, [[1]] * 2, {}, where)


@pytest.mark.parametrize("returned, message", [
    ([1.0, 2.0], "reward function f returned 2 rewards for 3 completions; return one per completion"),
    (1.0, "reward function f returned no list of 3 rewards \\(got float\\)"),
    (None, "reward function f returned no list of 3 rewards \\(got NoneType\\)"),
    ("101", "reward function f returned no list of 3 rewards \\(got str\\)"),
    (np.zeros((3, 1)), "\\(got an array of shape \\(3, 1\\)\\)"),
    ([1.0, "0.5", 1.0], "reward function f returned '0.5' on data/train.jsonl, line 4; return a finite number"),
    ([1.0, 1.0, [1.0]], "reward function f returned \\[1.0\\] on data/train.jsonl, line 5"),
    ([1.0, math.nan, 1.0], "reward function f returned nan on data/train.jsonl, line 4"),
    (np.array([1.0, 2.0, np.inf]), "reward function f returned inf on data/train.jsonl, line 5"),
])
def test_bad_results_are_clean_errors(returned, message):
    rs = RewardSet([RewardFunction("f", lambda **_: returned)])
    with pytest.raises(UserError, match=message) as e:
        rs.compute(["p"] * 3, ["c"] * 3, [[1]] * 3, {}, where)
    assert "\n" not in str(e.value)


def test_numpy_scalars_and_object_arrays_are_numbers():
    rs = RewardSet([RewardFunction("f", fixed([np.float32(0.5), np.int64(2), np.bool_(True), None]))])
    per, total = rs.compute(["p"] * 4, ["c"] * 4, [[1]] * 4, {}, where)
    assert per[:3, 0].tolist() == [0.5, 2.0, 1.0] and math.isnan(per[3, 0])
    assert total.tolist() == [0.5, 2.0, 1.0, 0.0]


def test_argument_collisions_and_missing_arguments():
    with pytest.raises(UserError, match="key 'tolerance' is also a data column"):
        RewardSet([RewardFunction("t", fixed([1]), {"tolerance": 1})]).compute(
            ["p"], ["c"], [[1]], {"tolerance": [0.1]}, where)
    with pytest.raises(UserError, match="a column named 'completions'"):
        load_rewards(["exact_match"]).compute(["p"], ["c"], [[1]], {"completions": ["x"]}, where)

    def needs_gold(completions, gold):
        return [1.0] * len(completions)

    with pytest.raises(UserError, match="reward function needs_gold needs argument 'gold', which is none of "
                                        "prompts, completions, completion_ids, a data column \\(answer\\)"):
        RewardSet([RewardFunction("needs_gold", needs_gold)]).compute(["p"], ["c"], [[1]], {"answer": [1]}, where)


def test_callables_from_python_and_an_empty_batch():
    rs = load_rewards([fixed([]), {"function": exact_match, "name": "em"}])
    assert rs.names == ["fn", "em"]
    per, total = rs.compute([], [], [], {"answer": []}, where)
    assert per.shape == (0, 2) and total.shape == (0,)
