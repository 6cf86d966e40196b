"""Tests for grpo.rewards: answer extraction, math equivalence, format, and the code sandbox.

Sandbox tests check containment from the outside: the files they target, the test process's
children, stray sandbox processes, and wall time.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo import rewards
from grpo.rewards import sandbox as _sandbox
from grpo.rewards import (REWARD_FUNCTIONS, code_reward, code_rewards, extract_answer,
                          format_reward, math_accuracy, math_equal)

# --------------------------------------------------------------------------------------------
# Math table: (prediction, gold, expected)
# --------------------------------------------------------------------------------------------

MATH_CASES = [
    # integers and decimals
    ("42", "42", True), ("42.0", "42", True), ("42.00", "42", True), ("1,000", "1000", True),
    ("1{,}000", "1000", True), ("1,234,567", "1234567", True), ("-7", "-7.000", True),
    ("41", "42", False), ("0.5", "0.54", False), ("123456789012", "123456789013", False),
    ("3", "3.0001", False),
    # fractions
    (r"\frac{1}{2}", "0.5", True), (r"\dfrac{3}{4}", "0.75", True), (r"\tfrac34", "3/4", True),
    ("6/8", r"\frac{3}{4}", True), (r"\frac{2}{3}", r"\frac{3}{2}", False),
    (r"1\frac{1}{2}", r"\frac{3}{2}", True), (r"-\frac{1}{3}", r"\frac{-1}{3}", True),
    # percentages, scientific notation
    (r"50\%", "0.5", True), ("50", r"50\%", False), (r"0.5\%", r"50\%", False),
    (r"12.5\%", r"\frac{1}{8}", True), ("3.2e5", "320000", True),
    (r"3.2\times 10^{5}", "320000", True), ("1.5 \\cdot 10^{-3}", "0.0015", True),
    ("3.2e5", "3.2e6", False),
    # radicals, pi, products, brackets
    (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}", True),
    (r"\sqrt{3}", r"\sqrt{2}", False), (r"\frac{\pi}{2}", r"\pi/2", True),
    (r"2\pi", r"\pi", False), (r"2 \cdot 3", "6", True), (r"2 \times 3", "6", True),
    (r"\left( \frac{1}{2} \right)", r"\frac12", True), (r"\sqrt[3]{8}", "2", True),
    # units and degrees
    (r"10\text{ cm}", "10", True), (r"5 \text{ meters}", "5", True), ("12 inches", "12", True),
    (r"5\ \text{cm}^2", "5", True), (r"5\ \text{cm}^2", "25", False),
    (r"\$5", "5", True), (r"30^\circ", "30", True), (r"30^{\circ}", r"\frac{\pi}{6}", True),
    (r"45^\circ", "30", False), (r"\text{Monday}", "monday", True),
    (r"\text{Tuesday}", "Monday", False),
    # algebra
    ("(x+1)^2", "x^2+2x+1", True), ("(x+1)(x-1)", "x^2-1", True), ("(x+1)^2", "x^2+1", False),
    (r"\frac{x}{2}", "0.5x", True), (r"\sin^2 x + \cos^2 x", "1", True),
    (r"\sqrt{x^2}", "x", False), ("x^2", "y^2", False), ("2i+3", "3+2i", True),
    (r"e^{i\pi}", "-1", True), (r"\ln(e^2)", "2", True),
    # equations
    ("x = 5", "5", True), ("x=5", "x = 5", True), ("k = 5", "x = 5", True),
    (r"f(x) = x^2", "x^2", True), ("y = 2x+1", "2x - y + 1 = 0", True),
    ("3x - y + 13 = 0", "3x + 4y + 14 = 0", False), ("x = 5", "6", False),
    ("(x, y) = (1, 2)", "(1, 2)", True),
    # inequalities and intervals
    ("x > 5", r"(5, \infty)", True), (r"x \ge 5", r"(5, \infty)", False),
    (r"1 \le x < 2", "[1, 2)", True), (r"x \in [1,2]", "[1, 2]", True),
    ("[1,2]", "(1,2)", False), ("[1,2)", "[1,2]", False),
    (r"(-\infty, 3] \cup (4, \infty)", r"(4,\infty)\cup(-\infty,3]", True),
    (r"-\infty", r"\infty", False), (r"\infty", r"\infty", True),
    # tuples, sets, several answers, matrices
    ("(1,2)", "(1, 2)", True), ("(1,2)", "(2,1)", False), ("(1,2,3)", "(1,2)", False),
    (r"\{1,2\}", r"\{2,1\}", True), (r"\{1,2\}", r"\{1,3\}", False), ("1, 2", "2, 1", True),
    (r"x=1 \text{ or } x=2", "1, 2", True), ("1, 2", "1, 2, 3", False),
    (r"\emptyset", r"\{\}", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{bmatrix}1&2\\3&4\end{bmatrix}", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&2\\4&3\end{pmatrix}", False),
    (r"\begin{pmatrix}1&2\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", False),
    # plus-minus
    (r"\pm 2021", "2021", False), (r"\pm 2021", "2021, -2021", True),
    (r"2 \pm \sqrt{3}", r"2+\sqrt3, 2-\sqrt3", True), (r"x = \pm 2", "2", False),
    # decimals are exact: no rounding window for a wrong answer to fall into
    ("0.3333", r"\frac13", False), ("0.33", r"\frac13", False), ("0.333", r"\frac13", False),
    ("3.1416", r"\pi", False), ("3.14", r"\pi", False), ("1.414", r"\sqrt{2}", False),
    ("1.415", r"\sqrt{2}", False), ("0.8660", r"\frac{\sqrt{3}}{2}", False),
    ("0.6666", r"\frac23", False), ("0.6665", r"\frac23", False), ("0.125", r"\frac18", True),
    # cases other verifiers get wrong
    ("1/2004!", "1/2006!", False), (r"\frac{1}{2004!}", r"\frac{1}{2004!}", True),
    ("2^{99}", "2^{98}", False), ("2^{99}", "633825300114114700748351602688", True),
    (r"10^{-30}", r"10^{-31}", False), (r"\frac{1}{2", r"\frac{1}{2}", False),
    (r"\sqrt{2", r"\sqrt{2}", False), ("(1, 2", "(1, 2)", False),
    # wrappers
    (r"\boxed{5}", "5", True), ("$5$", "5", True), ("5.", "5", True), (r"\(7\)", "7", True),
    ("A", "(A)", True), ("B", "A", False),
    # issue 15: times, units with digits, spaces between digits, unicode, sets of reals
    ("12:00", "1:00", False), ("1:00 pm", "13:00", True), ("3.000", "3.0001", False),
    (r"2\text{5 kg}", "2", False), (r"5\text{ times }2", "52", False), ("2 3", "23", False),
    (r"0.5\%", "0.5", False), ("(1,234)", "(1, 234)", True), ("x\u00b2", "x^2", True),
    ("\u00bd", r"\frac{1}{2}", True), (r"\mathbb{R}", r"(-\infty, \infty)", True),
    (r"\{x \mid x > 3\}", r"(3, \infty)", True),
]


def test_math_table_is_large_and_balanced():
    assert len(MATH_CASES) >= 80
    assert sum(e for _, _, e in MATH_CASES) >= 30
    assert sum(not e for _, _, e in MATH_CASES) >= 30


@pytest.mark.parametrize("pred,gold,expected", MATH_CASES)
def test_math_equal_table(pred, gold, expected):
    assert math_equal(pred, gold) is expected


@pytest.mark.parametrize("pred,gold,expected", MATH_CASES[::4])
def test_math_equal_is_symmetric_on_numbers_and_sets(pred, gold, expected):
    # Equivalence should not depend on which side is the reference (units/wrappers aside).
    if any(tok in pred + gold for tok in ("=", "\\in", "<", ">", "\\le", "\\ge", "text", "$")):
        pytest.skip("assignment / text forms are intentionally one-sided")
    assert math_equal(gold, pred) is expected


def test_math_verify_side_by_side():
    """Optional: compare with math-verify on the table; we must be right wherever it is."""
    mv = pytest.importorskip("math_verify")
    ours = theirs = 0
    for pred, gold, expected in MATH_CASES:
        ours += math_equal(pred, gold) is expected
        try:
            verdict = bool(mv.verify(mv.parse(f"${gold}$"), mv.parse(f"${pred}$")))
        except Exception:  # noqa: BLE001 - its failures count as wrong answers
            verdict = None
        theirs += verdict is expected
    assert ours == len(MATH_CASES)
    assert ours >= theirs


# --------------------------------------------------------------------------------------------
# Adversarial math inputs: bounded time, never raises
# --------------------------------------------------------------------------------------------

ADVERSARIAL = [
    "10^{10^{10}}", "2^{2^{2^{2^{2^{2}}}}}", "9^{9^{9^{9}}}", "(10^{100})!", "1000000!",
    "(" * 300 + "1" + ")" * 300, "{" * 300 + "1" + "}" * 300, r"\frac{" * 200 + "1",
    "", "   ", "garbage ### \\\\ }{", "\\", "$", "1" * 1_000_000, "x" * 1_000_000,
    r"\sqrt{" * 50 + "2" + "}" * 50, "(x+1)^{100000}", r"\begin{pmatrix}1&2", None, 12345,
]


@pytest.mark.parametrize("bad", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_bounded(bad):
    start = time.monotonic()
    assert math_equal(bad, "2", timeout=2.0) is False
    assert math_equal("2", bad, timeout=2.0) is False
    assert time.monotonic() - start < 2 * 2.0 + 3.0  # two calls, plus a worker restart


def test_huge_power_is_refused_not_computed():
    start = time.monotonic()
    assert math_equal("10^{10^{10}}", "10^{10^{10}}+1", timeout=5.0) is False
    assert time.monotonic() - start < 3.0


def test_timeout_kills_worker_and_recovers():
    # A distinct symbolic comparison (not cached) with an absurdly small budget must give up,
    # and the next call must work on a fresh worker.
    start = time.monotonic()
    assert math_equal(r"\frac{x^{3}+7x}{\sin(x)+\cos(x)^{4}}", r"\tan(x)+17y", timeout=0.01) is False
    assert time.monotonic() - start < 2.0
    assert math_equal("(a+b)^2", "a^2+2ab+b^2", timeout=10.0) is True


def test_math_equal_from_many_threads():
    pairs = [(r"\frac{\sqrt{8}}{2}", r"\sqrt2", True), ("(x-1)^2", "x^2-2x+1", True),
             ("2^{10}", "1024", True), (r"\frac13", "0.3", False)] * 4
    with ThreadPoolExecutor(max_workers=8) as ex:
        results = list(ex.map(lambda c: math_equal(c[0], c[1], timeout=10.0), pairs))
    assert results == [e for _, _, e in pairs]


def test_math_accuracy():
    assert math_accuracy(r"so the answer is \boxed{\frac{1}{2}}.", "0.5") == 1.0
    assert math_accuracy("<think>x</think><answer>42</answer>", "42") == 1.0
    assert math_accuracy(r"\boxed{3}", r"The solution gives \boxed{3}.") == 1.0
    assert math_accuracy("the answer is 42", "42") == 0.0  # no final-answer marker
    assert math_accuracy(r"\boxed{41}", "42") == 0.0
    assert math_accuracy(None, "42") == 0.0


# --------------------------------------------------------------------------------------------
# Extraction and format
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{\{1,\{2\}\}}", r"\{1,\{2\}\}"),
    (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
    (r"$\boxed 5$.", "5"),
    (r"\fbox{7}", "7"),
    ("<answer> 12 </answer>", "12"),
    (r"<answer>so \boxed{3}</answer>", "3"),
    ("<answer>1</answer> later <answer>2</answer>", "2"),
    (r"\boxed{1} and a truncated \boxed{\frac{1}{2", None),
    ("no answer here", None),
    (r"\boxed{}", None),
    ("", None),
    (None, None),
    ([{"role": "assistant", "content": r"\boxed{9}"}], "9"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("<think>reasoning</think><answer>4</answer>", 1.0),
    ("<think>\nreasoning\n</think>\n<answer>\n4\n</answer>\n", 1.0),
    ("<think></think><answer>4</answer>", 0.0),
    ("<think>  </think><answer>4</answer>", 0.0),
    ("<think>r</think><answer> </answer>", 0.0),
    ("<think>r</think><answer>4</answer> trailing", 0.0),
    ("preamble <think>r</think><answer>4</answer>", 0.0),
    ("<think>r</think>text<answer>4</answer>", 0.0),
    ("<think>r</think><answer>4</answer><answer>5</answer>", 0.0),
    ("<think>a</think><think>b</think><answer>4</answer>", 0.0),
    ("<think>a<answer>4</answer></think><answer>4</answer>", 0.0),
    ("<answer>4</answer><think>r</think>", 0.0),
    ("<think>r</think><answer>4", 0.0),
    ("<THINK>r</THINK><ANSWER>4</ANSWER>", 0.0),
    ("<think>r</think><answer>4</answer>" + "x" * 2_000_000, 0.0),
    ("", 0.0),
    (None, 0.0),
])
def test_format_reward(text, expected):
    assert format_reward(text) == expected


def test_format_reward_think_prefilled():
    assert format_reward("reasoning</think><answer>4</answer>", think_prefilled=True) == 1.0
    assert format_reward("reasoning</think><answer>4</answer>") == 0.0
    assert format_reward("<think>r</think><answer>4</answer>", think_prefilled=True) == 0.0
    assert format_reward("</think><answer>4</answer>", think_prefilled=True) == 0.0
    chat = [{"role": "assistant", "content": "<think>r</think><answer>4</answer>"}]
    assert format_reward(chat) == 1.0


# --------------------------------------------------------------------------------------------
# Code reward
# --------------------------------------------------------------------------------------------

DOUBLE = "Here:\n```python\ndef f(x):\n    return 2 * x\n```\n"
ECHO_SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_code_reward_asserts():
    tests = ["assert f(2) == 4", "assert f(3) == 6", "assert f(3) == 7", "assert f(0) == 0"]
    assert code_reward(DOUBLE, tests, timeout=5) == 0.75


def test_code_reward_uses_last_block_and_answer_fallback():
    text = "```python\ndef f(x): return 0\n```\nfixed:\n```python\ndef f(x): return 2*x\n```"
    assert code_reward(text, ["assert f(2) == 4"]) == 1.0
    assert code_reward("<answer>def f(x): return 2*x</answer>", ["assert f(2) == 4"]) == 1.0
    assert code_reward("no code", ["assert True"]) == 0.0


def test_code_reward_stdio():
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10   \n\n"},
             {"input": "1 1", "output": "3"}]
    assert code_reward(ECHO_SUM, tests) == pytest.approx(2 / 3)


def test_code_reward_stdio_whole_output_required():
    prefix = "```python\nprint(1)\nprint(2)\n```"
    assert code_reward(prefix, [{"input": "", "output": "1\n2\n"}]) == 1.0
    assert code_reward(prefix, [{"input": "", "output": "1\n"}]) == 0.0  # extra line
    assert code_reward(prefix, [{"input": "", "output": "1\n2\n3\n"}]) == 0.0  # missing line
    crash = "```python\nprint(1)\nraise SystemExit(3)\n```"
    assert code_reward(crash, [{"input": "", "output": "1"}]) == 0.0  # non-zero exit


@pytest.mark.parametrize("cheat", [
    "import os\nos._exit(0)",  # leave before the tests run
    "import sys\nsys.exit(0)",
    "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'T 0 1\\n')\n    except OSError: pass",
    "print('T 0 1')",
])
def test_code_reward_cannot_be_faked(cheat):
    text = f"```python\ndef f(x): return -1\n{cheat}\n```"
    assert code_reward(text, ["assert f(1) == 2"]) == 0.0


def test_code_rewards_batch_is_parallel_and_ordered():
    loop = "```python\nwhile True: pass\n```"
    completions = [DOUBLE, loop, DOUBLE, loop, "nothing", DOUBLE]
    tests = [["assert f(1) == 2"]] * 5 + [None]
    start = time.monotonic()
    out = code_rewards(completions, tests, timeout=1.5, max_workers=6)
    assert out == [1.0, 0.0, 1.0, 0.0, 0.0, None]
    assert time.monotonic() - start < 1.5 * 2 + 2.0  # loops ran side by side


# --------------------------------------------------------------------------------------------
# Sandbox containment (checked from outside)
# --------------------------------------------------------------------------------------------


def _children() -> set[int]:
    kids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return kids


def _sandbox_processes() -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"grpo.rewards.sandbox`` runs" in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.fixture
def contained():
    """Yields a runner; afterwards, no child or sandbox process may remain."""
    before = _children()

    def run(code: str, timeout: float = 2.0, **kw) -> _sandbox.RunResult:
        start = time.monotonic()
        result = _sandbox.run(code, mode="stdio", stdin="", timeout=timeout, **kw)
        assert result.error is None
        assert time.monotonic() - start < timeout + 1.5
        return result

    yield run
    deadline = time.monotonic() + 2
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (_children() - before)
    assert not _sandbox_processes()


LAYERS = [True, False]  # audit hook on; and off, to check what the OS enforces alone


@functools.lru_cache(maxsize=1)
def _caps() -> dict:
    return _sandbox.capabilities()


def _need_os_layers(audit: bool) -> None:
    caps = _caps()
    if not caps["jail"]:
        pytest.skip(f"the sandbox cannot be built on this machine: {caps['error']}")


def test_capabilities_reported():
    caps = _sandbox.capabilities()
    assert set(caps) == {"jail", "error", "root"}
    assert caps["jail"] is (caps["error"] is None)


def test_infinite_loop_is_killed(contained):
    r = contained("while True:\n    pass", timeout=1.0)
    assert r.timed_out and r.returncode is None


def test_sleeping_child_group_is_killed(contained):
    r = contained("import time\ntime.sleep(30)", timeout=1.0)
    assert r.timed_out


@pytest.mark.parametrize("audit", LAYERS)
def test_fork_bomb_is_contained(contained, audit):
    _need_os_layers(audit)
    r = contained("import os\nwhile True:\n    os.fork()", audit=audit)
    assert r.returncode not in (0, None) or r.timed_out


@pytest.mark.parametrize("audit", LAYERS)
def test_memory_bomb_is_contained(contained, audit):
    _need_os_layers(audit)
    r = contained("x = bytearray(8 << 30)\nprint('allocated')", audit=audit)
    assert "allocated" not in r.stdout and r.returncode != 0


@pytest.mark.parametrize("audit", LAYERS)
def test_cannot_write_outside_workdir(contained, audit, tmp_path):
    _need_os_layers(audit)
    target = tmp_path / "pwned.txt"
    shared_tmp = f"/tmp/grpo-escape-{uuid.uuid4().hex}"
    code = (f"for p in [{str(target)!r}, {shared_tmp!r}]:\n"
            "    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    r = contained(code, audit=audit)
    assert r.stdout.strip() == "ok"  # the working directory itself is writable
    assert not target.exists()
    assert not os.path.exists(shared_tmp)


@pytest.mark.parametrize("audit", LAYERS)
def test_cannot_delete_outside_file(contained, audit, tmp_path):
    _need_os_layers(audit)
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    code = (f"import os, shutil\nfor f in (lambda: os.remove({str(victim)!r}),"
            f" lambda: shutil.rmtree({str(tmp_path)!r})):\n"
            "    try:\n        f()\n    except OSError:\n        pass")
    contained(code, audit=audit)
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("audit", LAYERS)
def test_os_system_is_contained(contained, audit, tmp_path):
    _need_os_layers(audit)
    marker = f"/tmp/grpo-escape-{uuid.uuid4().hex}"
    code = f"import os\ntry:\n    os.system('touch {marker}')\nexcept OSError:\n    pass"
    contained(code, audit=audit)
    time.sleep(0.2)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("audit", LAYERS)
def test_socket_cannot_connect(contained, audit):
    _need_os_layers(audit)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn)
                return
            except OSError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    code = ("import socket\ntry:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    s.sendall(b'hello')\n    print('connected')\nexcept OSError as e:\n"
            "    print('blocked')")
    r = contained(code, audit=audit)
    time.sleep(0.3)  # a connection attempt would have reached accept() by now
    done.set()
    t.join()
    server.close()
    assert not accepted
    assert "connected" not in r.stdout


def test_test_process_unharmed_after_escapes():
    # The previous tests ran in this process; it still works and has its cwd and files.
    assert os.getcwd() and os.path.exists(rewards.__file__)
    assert code_reward(DOUBLE, ["assert f(4) == 8"]) == 1.0


# --------------------------------------------------------------------------------------------
# TRL-style wrappers
# --------------------------------------------------------------------------------------------


def test_reward_function_registry():
    assert set(REWARD_FUNCTIONS) == {"accuracy", "format", "code"}


def test_math_accuracy_reward_wrapper():
    chat = [[{"role": "assistant", "content": r"\boxed{4}"}],
            [{"role": "assistant", "content": r"\boxed{5}"}],
            [{"role": "assistant", "content": r"\boxed{4}"}],
            [{"role": "assistant", "content": "no box"}]]
    out = REWARD_FUNCTIONS["accuracy"](["p"] * 4, chat, answer=["4", "4", None, r"\frac{"])
    assert out == [1.0, 0.0, None, None]


def test_format_reward_wrapper():
    out = REWARD_FUNCTIONS["format"](["p", "p"], ["<think>a</think><answer>b</answer>", "b"])
    assert out == [1.0, 0.0]
    out = REWARD_FUNCTIONS["format"](["p"], ["a</think><answer>b</answer>"], think_prefilled=True)
    assert out == [1.0]


def test_code_reward_wrapper():
    tests = [["assert f(1) == 2"], '[{"input": "2 3", "output": "5"}]', None]
    out = REWARD_FUNCTIONS["code"](["p"] * 3, [DOUBLE, ECHO_SUM, DOUBLE], tests=tests,
                                   trainer_state=None)
    assert out == [1.0, 1.0, None]
