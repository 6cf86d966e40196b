"""Honest solutions that use the standard library broadly, and attacks on the code and math rewards.

Data for tests/test_rewards_sandbox.py, tests/test_rewards_math.py and benchmarks/rewards_hostile.py:
every honest solution must pass all its tests; every attack (wrong code) must pass none. ``DOUBLE`` and
``ECHO_SUM`` are two right completions (an assert-tested ``f`` and a stdio program) shared by the
code-reward tests.

Resource attacks, at the end: programs and answers that try to stall or flood the reward rather
than forge it. ``HOSTILE_CODE`` and ``WORST_PROGRAMS`` (the latter against each of ``WORST_FORMS``:
the worst a row can cost) must score 0 within their bound; ``HOSTILE_MATH``'s (prediction, gold)
pairs must get ``math_equal``'s verdict within theirs. ``LIAR`` and ``PROTOCOL_PRINTER`` are
forgeries' bodies that benchmarks/rewards_hostile.py wraps into HumanEval rows (a value that says
yes to every question; verdict-protocol lines on every descriptor, then an exit).
"""

DOUBLE = "Here:\n```python\ndef f(x):\n    return 2 * x\n```\n"
ECHO_SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"

HONEST = [
    ("import heapq\ndef f(xs, k):\n    return heapq.nsmallest(k, xs)", ["assert f([5, 1, 4, 2], 2) == [1, 2]", "assert f([3], 1) in [[3]]"]),
    ("import bisect\ndef f(xs, x):\n    return bisect.bisect_left(xs, x)", ["assert f([1, 3, 5], 4) == 2\nassert f([1, 3, 5], 0) == 0"]),
    ("from typing import List, Optional\ndef f(xs: List[int]) -> Optional[int]:\n    return max(xs) if xs else None", ["assert f([1, 9, 2]) == 9", "assert f([]) is None"]),
    ("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\ndef f(a, b):\n    p = P(a, b)\n    return (p.x + p.y, repr(p))", ["assert f(1, 2) == (3, 'P(x=1, y=2)')"]),
    ("from fractions import Fraction\ndef f(a, b):\n    return str(Fraction(a, b))", ["assert f(2, 4) == '1/2'", "assert f(3, 1) == '3'"]),
    ("import random\ndef f(seed):\n    r = random.Random(seed)\n    xs = list(range(10))\n    r.shuffle(xs)\n    return sorted(xs)", ["assert f(1) == list(range(10))"]),
    ("import string\ndef f(s):\n    return ''.join(c for c in s if c in string.ascii_letters)", ["assert f('a1b2') == 'ab'"]),
    ("import datetime\ndef f(y, m, d):\n    return datetime.date(y, m, d).weekday()", ["assert f(2024, 1, 1) == 0", "assert f(2000, 2, 29) == 1"]),
    ("from collections import Counter\ndef f(s):\n    return Counter(s).most_common(1)[0][0]", ["assert f('abcbb') == 'b'"]),
    ("from collections import deque\ndef f(xs, k):\n    d = deque(xs)\n    d.rotate(k)\n    return list(d)", ["assert f([1, 2, 3], 1) == [3, 1, 2]"]),
    ("from collections import defaultdict\ndef f(ws):\n    g = defaultdict(list)\n    for w in ws:\n        g[len(w)].append(w)\n    return dict(g)", ["assert f(['a', 'bb', 'c']) == {1: ['a', 'c'], 2: ['bb']}"]),
    ("import itertools\ndef f(xs):\n    return [list(p) for p in itertools.permutations(xs)]", ["assert len(f([1, 2, 3])) == 6", "assert [1, 2] in f([1, 2])"]),
    ("from functools import lru_cache\n@lru_cache(None)\ndef f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)", ["assert f(30) == 832040"]),
    ("import functools\ndef f(xs):\n    return functools.reduce(lambda a, b: a * b, xs, 1)", ["assert f([1, 2, 3, 4]) == 24"]),
    ("import math\ndef f(r):\n    return math.pi * r * r", ["assert math.isclose(f(1), 3.141592653589793)", "assert abs(f(2) - 12.566370614359172) < 1e-9"]),
    ("import re\ndef f(s):\n    return re.findall(r'\\d+', s)", ["assert f('a12b3') == ['12', '3']"]),
    ("import json\ndef f(d):\n    return json.loads(json.dumps(d, sort_keys=True))", ["assert f({'b': 1, 'a': [1, 2]}) == {'a': [1, 2], 'b': 1}"]),
    ("from decimal import Decimal, getcontext\ndef f(a, b):\n    getcontext().prec = 10\n    return str(Decimal(a) / Decimal(b))", ["assert f(1, 3) == '0.3333333333'"]),
    ("import statistics\ndef f(xs):\n    return statistics.median(xs)", ["assert f([3, 1, 2]) == 2", "assert f([1, 2, 3, 4]) == 2.5"]),
    ("import enum\nclass Color(enum.Enum):\n    RED = 1\n    GREEN = 2\ndef f(n):\n    return Color(n).name", ["assert f(2) == 'GREEN'"]),
    ("import copy\ndef f(xs):\n    ys = copy.deepcopy(xs)\n    ys[0].append(9)\n    return xs, ys", ["assert f([[1]]) == ([[1]], [[1, 9]])"]),
    ("import operator\ndef f(pairs):\n    return sorted(pairs, key=operator.itemgetter(1))", ["assert f([(1, 'b'), (2, 'a')]) == [(2, 'a'), (1, 'b')]"]),
    ("import textwrap\ndef f(s, w):\n    return textwrap.wrap(s, w)", ["assert f('aaa bbb ccc', 7) == ['aaa bbb', 'ccc']"]),
    ("import unicodedata\ndef f(s):\n    return unicodedata.normalize('NFKD', s).encode('ascii', 'ignore').decode()", ["assert f('caf\\u00e9') == 'cafe'"]),
    ("import array\ndef f(xs):\n    a = array.array('i', xs)\n    a.reverse()\n    return a.tolist()", ["assert f([1, 2, 3]) == [3, 2, 1]"]),
    ("import struct\ndef f(x):\n    return struct.unpack('<I', struct.pack('<I', x))[0]", ["assert f(123456) == 123456"]),
    ("import string\ndef f(n):\n    return string.ascii_lowercase[:n]", ["assert f(3) == 'abc'"]),
    ("import calendar\ndef f(y):\n    return calendar.isleap(y)", ["assert f(2000) is True", "assert not f(1900)"]),
    ("from itertools import accumulate\ndef f(xs):\n    return list(accumulate(xs))", ["assert f([1, 2, 3]) == [1, 3, 6]"]),
    ("from itertools import combinations\ndef f(xs, k):\n    return len(list(combinations(xs, k)))", ["assert f(range(5), 2) == 10"]),
    ("import math\ndef f(a, b):\n    return math.gcd(a, b), math.lcm(a, b)", ["assert f(4, 6) == (2, 12)"]),
    ("import heapq\ndef f(lists):\n    return list(heapq.merge(*lists))", ["assert f([[1, 4], [2, 3]]) == [1, 2, 3, 4]"]),
    ("import bisect\ndef f(xs, x):\n    ys = list(xs)\n    bisect.insort(ys, x)\n    return ys", ["assert f([1, 3], 2) == [1, 2, 3]"]),
    ("from collections import OrderedDict\ndef f(pairs):\n    d = OrderedDict(pairs)\n    d.move_to_end(pairs[0][0])\n    return list(d)", ["assert f([('a', 1), ('b', 2)]) == ['b', 'a']"]),
    ("from collections import namedtuple\nPt = namedtuple('Pt', 'x y')\ndef f(a, b):\n    return tuple(Pt(a, b)._replace(x=0))", ["assert f(1, 2) == (0, 2)"]),
    ("import typing\nT = typing.TypeVar('T')\ndef f(xs: typing.Sequence[T]) -> typing.Tuple[T, ...]:\n    return tuple(reversed(xs))", ["assert f([1, 2]) == (2, 1)"]),
    ("import datetime\ndef f(s):\n    d = datetime.datetime.strptime(s, '%Y-%m-%d') + datetime.timedelta(days=1)\n    return d.strftime('%Y-%m-%d')", ["assert f('2024-02-28') == '2024-02-29'"]),
    ("import hashlib\ndef f(s):\n    return hashlib.sha256(s.encode()).hexdigest()[:8]", ["assert f('abc') == 'ba7816bf'"]),
    ("import base64\ndef f(s):\n    return base64.b64encode(s.encode()).decode()", ["assert f('hi') == 'aGk='"]),
    ("import zlib\ndef f(s):\n    return zlib.decompress(zlib.compress(s)) == s", ["assert f(b'abc' * 10)"]),
    ("import io\ndef f(s):\n    return [line.strip() for line in io.StringIO(s)]", ["assert f('a\\nb\\n') == ['a', 'b']"]),
    ("import sys\ndef f(n):\n    sys.setrecursionlimit(5000)\n    def depth(k):\n        return 0 if k == 0 else 1 + depth(k - 1)\n    return depth(n)", ["assert f(2000) == 2000"]),
    ("import cmath\ndef f(x):\n    return cmath.sqrt(x)", ["assert f(-4) == 2j"]),
    ("import fractions\ndef f(xs):\n    return float(sum(fractions.Fraction(1, x) for x in xs))", ["assert f([2, 4, 4]) == 1.0"]),
    ("import pprint\ndef f(d):\n    return pprint.pformat(d)", ["assert f({'a': 1}) == \"{'a': 1}\""]),
    ("import difflib\ndef f(a, b):\n    return round(difflib.SequenceMatcher(None, a, b).ratio(), 2)", ["assert f('abcd', 'abce') == 0.75"]),
    ("import abc\nclass Shape(abc.ABC):\n    @abc.abstractmethod\n    def area(self): ...\nclass Sq(Shape):\n    def __init__(self, s):\n        self.s = s\n    def area(self):\n        return self.s ** 2\ndef f(s):\n    return Sq(s).area()", ["assert f(3) == 9"]),
    ("import contextlib\ndef f(xs):\n    with contextlib.suppress(ZeroDivisionError):\n        return [1 / x for x in xs]\n    return None", ["assert f([1, 0]) is None", "assert f([2]) == [0.5]"]),
    ("import os\ndef f(s):\n    with open('/tmp/x.txt', 'w') as fh:\n        fh.write(s)\n    with open(os.path.join('/tmp', 'x.txt')) as fh:\n        return fh.read()", ["assert f('data') == 'data'"]),
    ("import csv, io\ndef f(s):\n    return list(csv.reader(io.StringIO(s)))", ["assert f('a,b\\n1,2\\n') == [['a', 'b'], ['1', '2']]"]),
    ("import logging\nlog = logging.getLogger('x')\ndef f(x):\n    log.warning('called %s', x)\n    return x + 1", ["assert f(1) == 2"]),
    ("import time\ndef f(x):\n    t = time.monotonic()\n    return x * 2 if time.monotonic() >= t else None", ["assert f(2) == 4"]),
    ("import itertools\ndef f(n):\n    return list(itertools.islice(itertools.count(1, 2), n))", ["for i in range(1, 4):\n    assert len(f(i)) == i", "assert f(3) == [1, 3, 5]"]),
    ("def f(s):\n    return s[::-1]", ["print(f('ab'))\nassert f('ab') == 'ba'", "assert all(f(w) == w[::-1] for w in ['ab', 'xyz'])", "assert [f(w) for w in 'ab'] == ['a', 'b']"]),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n    def size(self):\n        return len(self.items)", ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.size() == 1"]),
    ("def f(xs):\n    xs.sort()", ["x = [3, 1, 2]\nf(x)\nassert x == [1, 2, 3]"]),
    ("def f(x):\n    return float('nan') if x is None else x / 2", ["assert f(3) == 1.5", "assert f(None) != f(None)"]),
    ("def has_close_elements(xs, t):\n    return any(abs(a - b) < t for i, a in enumerate(xs) for b in xs[i + 1:])",
     ["METADATA = {}\n\ndef check(candidate):\n    assert candidate([1.0, 2.0, 3.9], 0.3) == False\n    assert candidate([1.0, 1.2], 0.5) == True\n\ncheck(has_close_elements)\n"]),
    ("import math\ndef f(n):\n    return math.factorial(n)", ["assert f(2000) == math.factorial(2000)", "assert str(f(25)) == '15511210043330985984000000'"]),
    ("def f(n):\n    return {i: i * i for i in range(n)}", ["assert f(3) == {0: 0, 1: 1, 2: 4}", "assert set(f(4)) == {0, 1, 2, 3}"]),
    # Unusual but legitimate programs and values (issue 36, round 3): every one must pass.
    ("def f(n):\n    for i in range(n):\n        yield i * i", ["assert list(f(4)) == [0, 1, 4, 9]", "import random\nfor _ in range(5):\n    n = random.randint(1, 9)\n    assert list(f(n)) == [i * i for i in range(n)]"]),
    ("class Acc:\n    def __init__(self):\n        self.t = 0\n    def add(self, x):\n        self.t += x\n        return self.t", ["a = Acc()\nimport random\ntotal = 0\nfor _ in range(5):\n    x = random.randint(1, 9)\n    total += x\n    assert a.add(x) == total"]),
    ("count = 0\ndef f(x):\n    global count\n    count += 1\n    return x * count", ["assert f(2) == 2\nassert f(2) == 4"]),
    ("def f(x):\n    for i in range(300000):\n        print('noise', i, 'PASS 0')\n    return x", ["assert f(3) == 3"]),
    ("def f(n):\n    return list(range(n))", ["assert f(10 ** 6) == list(range(10 ** 6))"]),
    ("def f(n):\n    return {str(i): [i, -i] for i in range(n)}", ["assert f(30000)['29999'] == [29999, -29999]", "assert len(f(30000)) == 30000"]),
    ("def f(n):\n    return 'x' * n + '\\u00e9\\U0001F600'", ["assert f(10 ** 6) == 'x' * 10 ** 6 + '\u00e9\U0001F600'"]),
    ("def f():\n    return {(1, 2): 'a', (3,): b'\\x00'}", ["assert f() == {(1, 2): 'a', (3,): b'\\x00'}"]),
    ("def f():\n    return [float('inf'), -0.0, 1+2j]", ["import math\nr = f()\nassert math.isinf(r[0]) and math.copysign(1, r[1]) == -1 and r[2] == complex(1, 2)"]),
    ("from collections import namedtuple, Counter, OrderedDict, deque\nP = namedtuple('P', 'x y')\ndef f(s):\n    return P(1, 2), Counter(s), OrderedDict(a=1), deque([1, 2], maxlen=3)", ["from collections import Counter, deque\np, c, o, d = f('aab')\nassert p == (1, 2) and c == Counter('aab') and o == {'a': 1} and d == deque([1, 2])"]),
    ("import enum\nclass C(enum.IntEnum):\n    A = 1\nclass S(str, enum.Enum):\n    X = 'x'\ndef f():\n    return C.A, S.X", ["assert f() == (1, 'x')"]),
    ("from fractions import Fraction\nfrom decimal import Decimal\nimport datetime\ndef f():\n    return Fraction(1, 3), Decimal('1.10'), datetime.date(2024, 2, 29), datetime.timedelta(days=2)", ["from fractions import Fraction\nfrom decimal import Decimal\nimport datetime\nassert f() == (Fraction(1, 3), Decimal('1.1'), datetime.date(2024, 2, 29), datetime.timedelta(hours=48))"]),
    ("def f(d):\n    return d.keys(), range(3), map(str, [1, 2])", ["k, r, m = f({'a': 1, 'b': 2})\nassert k == {'a', 'b'} and list(r) == [0, 1, 2] and list(m) == ['1', '2']"]),
    ("import itertools\ndef f():\n    return itertools.count()", ["g = f()\nassert next(g) == 0\nassert next(g) == 1"]),
    ("def f(w):\n    return w[::-1]", ["for w in {'ab', 'cd', 'ef', 'gh', 'ij', 'kl'}:\n    assert f(w) == w[::-1]", "assert [f(w) for w in {'ab', 'cd', 'ef'}] == [w[::-1] for w in {'ab', 'cd', 'ef'}]"]),
    ("def f(p):\n    return p[0] + p[1]", ["for p in {(1, 2), (3, 4), ('a', 'b')}:\n    assert f(p) == p[0] + p[1]", "d = {'a': 'b', 'c': 'd'}\nfor k, v in d.items():\n    assert f((k, v)) == k + v"]),
    ("def f(xs):\n    xs.sort()\n    return xs", ["xs = [3, 1, 2]\nassert f(xs) == sorted(xs)", "xs = [3, 1, 2]\nassert f(xs) is xs", "xs = [3, 1, 2]\nf(xs)\nassert xs == [1, 2, 3]"]),
    ("def f(g):\n    return [row[::-1] for row in g]", ["grid = [[1, 2], [3, 4]]\nassert f(grid) == [[2, 1], [4, 3]]\nassert grid == [[1, 2], [3, 4]]"]),
    ("import math\ndef f(x):\n    return x + 1", ["x = math.sqrt(16)\nassert f(x) == x + 1", "xs = sorted([3, 1, 2])\nassert f(xs[0]) == xs[0] + 1", "x = 3\nassert f(x) == x + 1\nx = 5\nassert f(x) == x + 1"]),
    ("import random\ndef f(n):\n    r = random.Random(42)\n    return [r.randint(0, 9) for _ in range(n)]", ["import random\nr = random.Random(42)\nassert f(5) == [r.randint(0, 9) for _ in range(5)]"]),
    ("import sys\nsys.setrecursionlimit(100000)\ndef f(n):\n    return 0 if n == 0 else 1 + f(n - 1)", ["assert f(20000) == 20000"]),
    ("def f(*, a=1, **kw):\n    return a + sum(kw.values())", ["assert f(a=2, b=3) == 5"]),
    ("def f(n):\n    return 3 ** n", ["assert f(20000) == 3 ** 20000", "assert f(5000) % 7 == pow(3, 5000, 7)"]),
    ("import hashlib, json\ndef f(d):\n    return json.dumps(d, sort_keys=True)", ["import hashlib, json\nassert json.loads(f({'b': 1, 'a': 2})) == {'a': 2, 'b': 1}\nassert hashlib.md5(f({}).encode()).hexdigest() == hashlib.md5(b'{}').hexdigest()"]),
    ("def f(s):\n    return s.upper()", ["assert f('stra\u00dfe \u00e9 \U0001F600') == 'STRASSE \u00c9 \U0001F600'"]),
]

WRONG = "def f(*a, **k):\n    return -1\n"
# Tests every attack is run against (the right answers are those of 2*x).
ATTACK_TESTS = [
    "assert f(1) == 2\nassert f(2) == 4", "assert f(1) in [2, 3]", "assert 2 == f(1) == 2",
    "assert [2].count(f(1)) == 1", "assert (2,).index(f(1)) == 0", "r = f(3)\nassert r == 6",
    "assert f(1) is not None and f(1) == 2", "assert isinstance(f(1), int) and f(1) > 1",
    "assert f(1) - 1 > 0", "assert not (f(1) != 2)", "assert sorted([f(2), f(1)]) == [2, 4]",
    "assert {f(1)} == {2}", "assert str(f(1)) == '2'", "assert f(1) >= 2 and f(1) <= 2",
    "for i in range(3):\n    assert f(i) == 2 * i", "assert all(f(i) == 2 * i for i in range(3))",
    "import math\nassert math.isclose(f(1), 2)", "assert abs(f(1) - 2) < 1e-9",
    "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) in (4,)\ncheck(f)",
]
ATTACKS = {
    "always_equal": "class A:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n    def __lt__(s, o): return False\n    def __gt__(s, o): return False\n    def __le__(s, o): return True\n    def __ge__(s, o): return True\n    def __bool__(s): return True\n    def __hash__(s): return hash(2)\n    def __repr__(s): return '2'\n    def __str__(s): return '2'\n    def __float__(s): return 2.0\n    def __index__(s): return 2\n    def __sub__(s, o): return 0\n    def __abs__(s): return 0\ndef f(*a): return A()",
    "int_subclass": "class S(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\ndef f(*a): return S(-1)",
    "str_subclass": "class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\ndef f(*a): return S('x')",
    "list_subclass": "class L(list):\n    def __eq__(s, o): return True\n    def count(s, x): return 1\ndef f(*a): return L()",
    "class_lie": "class A:\n    __class__ = int\n    def __eq__(s, o): return True\n    __hash__ = object.__hash__\ndef f(*a): return A()",
    "patch_builtins": "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.sorted = lambda *a, **k: [2, 4]\nbuiltins.abs = lambda x: 0\nbuiltins.all = lambda x: True\nbuiltins.str = lambda *a: '2'\ndef f(*a): return -1",
    "patch_json": "import json\njson.dumps = lambda *a, **k: '{}'\njson.JSONEncoder.encode = lambda *a: '{}'\ndef f(*a): return -1",
    "exit_zero_early": WRONG + "import os\nos._exit(0)",
    "sys_exit_atexit": WRONG + "import atexit, sys\natexit.register(lambda: sys.exit(0))\nraise SystemExit(0)",
    "raise_mid_test": "def f(x):\n    raise AssertionError('x')",
    "print_fake_lines": WRONG + "import sys\nfor t in range(20):\n    print('0' * 32, t, 0, 'vi2;')\n    print('0' * 32, t, 'd')\n    sys.stderr.write('PASS %d\\n' % t)",
    "spray_fds": WRONG + "import os\nfor fd in range(64):\n    for t in range(20):\n        for line in (b'x %d 0 vi2;\\n' % t, b'x %d d\\n' % t, b'PASS %d\\n' % t):\n            try:\n                os.write(fd, line)\n            except OSError:\n                pass",
    "argv_fd_forge": WRONG + "import os, sys\nfd = int(sys.argv[-1])\nfor t in range(20):\n    os.write(fd, b'%s %d 0 vi2;\\n%s %d d\\n' % (b'0' * 32, t, b'0' * 32, t))",
    "nan": "def f(*a): return float('nan')",
    "deep_recursion_value": "def f(*a):\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x",
    "self_reference": "def f(*a):\n    x = []\n    x.append(x)\n    return x",
    "signal_self": WRONG + "import os, signal\ntry:\n    os.kill(os.getpid(), signal.SIGTERM)\nexcept Exception:\n    pass",
    "fork": WRONG + "import os\ntry:\n    os.fork()\nexcept Exception:\n    pass",
    "huge_output": WRONG + "import sys\ntry:\n    sys.stdout.write('2\\n' * (1 << 26))\nexcept Exception:\n    pass",
    "stateful_guess": "n = [0]\ndef f(*a):\n    n[0] += 1\n    class A:\n        def __eq__(s, o): return True\n        __hash__ = object.__hash__\n    return A()",
    "getframe": WRONG + "import sys\ntry:\n    fr = sys._getframe(1)\n    print(fr.f_locals)\nexcept Exception:\n    pass",
    "gc_scan": WRONG + "try:\n    import gc\n    for o in gc.get_objects():\n        pass\nexcept Exception:\n    pass",
    "bool_subclass_via_int": "def f(*a): return True",
    "shadow_builtins": "def isinstance(*a): return True\ndef sorted(*a, **k): return [2, 4]\ndef abs(x): return 0\ndef all(x): return True\ndef str(x): return '2'\nclass math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef f(*a): return -1",
}

# Traced forms (loops that assign, values only the judge computes): every attack must forge none
# of these either.
ATTACK_TESTS += [
    "for i in range(3):\n    x = i + 1\n    assert f(x) == 2 * x",
    "import random\nassert f(1) == 2\nfor _ in range(5):\n    x = random.randint(0, 9)\n    assert f(x) == x + x",
    "from random import randint\nxs = []\nfor _ in range(4):\n    v = randint(-5, 5)\n    if v == 0:\n        v = 1\n    xs.append(v)\nfor v in xs:\n    y = f(v)\n    assert y == 2 * v",
]

# Problems whose tests call helpers the problem itself provides (HumanEval's form: the prompt
# defines them, ``check(candidate)`` calls them). Written for these tests, in the style of
# HumanEval; ``trusted`` is the whole prompt (helpers plus the stub of the function under test,
# which the judge leaves out). Each has a right ``solution`` and ``forgeries`` that redefine or
# patch the helpers, read their source, lie about values or count calls: every forgery must
# score below 1.0, every solution 1.0.
TRUSTED_PROBLEMS = {
    "poly_root": {
        "trusted": 'import math\n\n\ndef poly(xs: list, x: float):\n    """xs[0] + xs[1] * x + ... + xs[n] * x^n"""\n'
                   '    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n\n'
                   'def find_root(xs: list):\n    """A zero of the odd-degree polynomial xs (bisection is fine)."""\n',
        "solution": "import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n"
                    "def find_root(xs):\n    lo, hi = -1.0, 1.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n        lo, hi = 2 * lo, 2 * hi\n"
                    "    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2\n        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n"
                    "        else:\n            hi = mid\n    return lo\n",
        "test": "def check(candidate):\n    import math\n    import random\n    import copy\n    rng = random.Random(7)\n"
                "    for _ in range(30):\n        n = 2 * rng.randint(1, 3)\n        coeffs = []\n        for _ in range(n):\n"
                "            c = rng.randint(-9, 9)\n            if c == 0:\n                c = 1\n            coeffs.append(c)\n"
                "        root = candidate(copy.deepcopy(coeffs))\n        assert math.fabs(poly(coeffs, root)) < 1e-4\n\ncheck(find_root)\n",
        "forgeries": {
            "poly_is_zero": "def poly(xs, x):\n    return 0.0\ndef find_root(xs):\n    return 0.0\n",
            "patch_math_and_sum": "import math, builtins\nmath.pow = lambda a, b: 0.0\nmath.fabs = lambda a: 0.0\nbuiltins.sum = lambda *a, **k: 0.0\ndef find_root(xs):\n    return 0.0\n",
            "nan_root": "def find_root(xs):\n    return float('nan')\n",
            "lying_float": "class R(float):\n    def __abs__(s): return 0.0\n    def __lt__(s, o): return True\n    def __mul__(s, o): return 0.0\n    __rmul__ = __mul__\ndef find_root(xs):\n    return R(123.0)\n",
            "rebind_test_names": "def find_root(xs):\n    global coeffs, poly\n    coeffs = [0, 0]\n    poly = lambda *a: 0.0\n    return 0.0\n",
        },
    },
    "rot_cipher": {
        "trusted": "SHIFT = 7\n\n\ndef encode_rot(s: str):\n    \"\"\"Shift every lowercase letter by SHIFT places.\"\"\"\n"
                   "    return ''.join(chr((ord(ch) - 97 + SHIFT) % 26 + 97) for ch in s)\n\n\n"
                   "def decode_rot(s: str):\n    \"\"\"Undo encode_rot.\"\"\"\n",
        "solution": "def decode_rot(s):\n    return ''.join(chr((ord(ch) - 97 - 7) % 26 + 97) for ch in s)\n",
        "test": "def check(candidate):\n    from random import randint, choice\n    import string\n    letters = string.ascii_lowercase\n"
                "    assert candidate('') == ''\n    for _ in range(40):\n        str = ''.join(choice(letters) for i in range(randint(5, 15)))\n"
                "        encoded = encode_rot(str)\n        assert candidate(encoded) == str\n\ncheck(decode_rot)\n",
        "forgeries": {
            "identity_pair": "def encode_rot(s):\n    return s\ndef decode_rot(s):\n    return s\n",
            "decode_is_encode": "def encode_rot(s):\n    return s\ndef decode_rot(s):\n    return encode_rot(s)\n",
            "read_trusted_source": "import os, sys\nfound = []\nfor root in ('/', '/tmp'):\n    try:\n        for name in os.listdir(root):\n            found.append(name)\n    except OSError:\n        pass\n"
                                   "text = repr(globals()) + repr(sys.argv) + repr(os.environ) + repr(found)\nSHIFT = 7 if 'SHIFT' in text else 3\n"
                                   "def decode_rot(s):\n    return ''.join(chr((ord(ch) - 97 - SHIFT) % 26 + 97) for ch in s)\n",
            "lookup_table": "def decode_rot(s):\n    return {'': ''}.get(s, 'a')\n",
            "always_equal_str": "class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\ndef decode_rot(s):\n    return S(s)\n",
            "patch_random": "import random\nrandom.randint = lambda a, b: 5\nrandom.choice = lambda seq: 'a'\ndef decode_rot(s):\n    return 'aaaaa'\n",
        },
    },
    "add": {
        "trusted": "def add(x: int, y: int):\n    \"\"\"x + y\"\"\"\n",
        "solution": "def add(x, y):\n    return x + y\n",
        "test": "def check(candidate):\n    import random\n    assert candidate(0, 1) == 1\n    assert candidate(2, 3) == 5\n"
                "    for i in range(50):\n        x, y = random.randint(0, 1000), random.randint(0, 1000)\n        assert candidate(x, y) == x + y\n\ncheck(add)\n",
        "forgeries": {
            "only_the_literals": "def add(x, y):\n    return {(0, 1): 1, (2, 3): 5}.get((x, y), 0)\n",
            "stateful_count": "n = [0]\ndef add(x, y):\n    n[0] += 1\n    return x + y if n[0] < 10 else 0\n",
            "patch_randint": "import random\nrandom.randint = lambda a, b: 0\ndef add(x, y):\n    return 1 if (x, y) == (0, 1) else 5 if (x, y) == (2, 3) else 0\n",
        },
    },
}


# stdin/stdout programs in the idioms of competitive programming: every one must pass.
HONEST_STDIO = [
    ("import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)\nexit(0)", [{"input": "1 2\n3 4\n", "output": "3\n7\n"}]),
    ("print(sum(map(int, input().split())))\nquit()", [{"input": "1 2\n", "output": "3\n"}]),
    ("data = open(0).read().split()\nprint(sum(map(int, data)))", [{"input": "1 2\n3 4\n", "output": "10\n"}]),
    ("import sys\ndata = sys.stdin.buffer.read().split()\nsys.stdout.write(str(sum(map(int, data))) + '\\n')\nsys.exit()", [{"input": "1 2\n3 4\n", "output": "10\n"}]),
    ("import signal\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)\nprint('h\u00e9llo \U0001F600')", [{"input": "", "output": "h\u00e9llo \U0001F600\n"}]),
    ("print('\\n'.join(str(i) for i in range(200000)))", [{"input": "", "output": "\n".join(str(i) for i in range(200000))}]),
    ("import sys\nsys.setrecursionlimit(100000)\ndef d(n):\n    return 0 if n == 0 else 1 + d(n - 1)\ndef main():\n    print(d(int(input())))\nif __name__ == '__main__':\n    main()", [{"input": "30000\n", "output": "30000\n"}]),
]

# Forgeries of what the judge reads (issue 36, round 3): each with an honest program that
# passes the same tests. name -> (honest, forged, tests). Every forgery must score below 1.0
# (None where noted in FORGED_UNSCORABLE); every honest program 1.0.
JUDGE_FORGERIES = {
    "global_rebinds_test_name": ("def f(y):\n    return 2 * y", "def f(y):\n    global x\n    x = 0\n    return 0", ["x = 3\nassert f(x) == x * 2"]),
    "globals_dict_rebinds": ("def f(y):\n    return 2 * y", "def f(y):\n    globals()['x'] = 0\n    return 0", ["x = 3\nassert f(x) == x * 2"]),
    "every_module_dict": ("def f(y):\n    return 2 * y", "import sys\ndef f(y):\n    for m in list(sys.modules.values()):\n        try:\n            vars(m)['x'] = 0\n        except Exception:\n            pass\n    return 0", ["x = 3\nassert f(x) == x * 2"]),
    "clear_input_list": ("def f(xs):\n    return sum(xs)", "def f(xs):\n    xs.clear()\n    return 0", ["xs = [1, 2, 3]\nassert f(xs) == sum(xs)"]),
    "clear_input_dict": ("def f(d):\n    return 10 * len(d)", "def f(d):\n    d.clear()\n    return 0", ["d = {'a': 1, 'b': 2}\nassert f(d) == len(d) * 10"]),
    "clear_input_later_statement": ("def f(xs):\n    return sorted(xs)", "def f(xs):\n    xs.clear()\n    return []", ["xs = [3, 1, 2]\nr = f(xs)\nassert r == sorted(xs)"]),
    "patch_builtins": ("def f(xs):\n    return min(xs)", "import builtins\nbuiltins.sorted = lambda *a, **k: [0]\nbuiltins.len = lambda x: 0\ndef f(xs):\n    return 0", ["xs = sorted([3, 1, 2])\nassert f(xs) == xs[0]", "assert len(str(f([40, 50]))) == 2"]),
    "replace_sys_modules": ("def f(x):\n    return x + 1", "import sys, types\nm = types.ModuleType('math')\nm.sqrt = lambda v: 0.0\nm.isclose = lambda *a, **k: True\nsys.modules['math'] = m\ndef f(x):\n    return 1.0", ["import math\nx = math.sqrt(16)\nassert f(x) == x + 1", "import math\nassert math.isclose(f(1.0), 2.0)"]),
    "patch_judge_module": ("def f(x):\n    return x * x", "import math\nmath.floor = lambda v: 0\ndef f(x):\n    return 0", ["import math\nx = math.floor(7.5)\nassert f(x) == x * x"]),
    "patch_json_encoder": ("def f(x):\n    return [2 * x]", "import json, json.encoder\njson.encoder.c_make_encoder = None\njson.JSONEncoder.encode = lambda s, o: '[4]'\njson.dumps = lambda *a, **k: '[4]'\ndef f(x):\n    return [-1]", ["assert f(2) == [4]"]),
    "class_attribute_lie": ("def f(x):\n    return 2 * x", "class A:\n    __class__ = int\n    def __eq__(s, o):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return A()", ["assert f(2) == 4"]),
    "lying_eq_subclass": ("def f(x):\n    return 2 * x", "class S(int):\n    def __eq__(s, o):\n        return True\n    __ne__ = lambda s, o: False\n    __hash__ = lambda s: hash(4)\ndef f(x):\n    return S(-1)", ["assert f(2) == 4", "assert f(2) in {4, 5}", "assert not f(2) != 4"]),
    "lying_bool": ("def f(x):\n    return x % 2 == 0", "class B:\n    n = 0\n    def __bool__(s):\n        B.n += 1\n        return B.n % 2 == 1\ndef f(x):\n    return B()", ["assert f(4)\nassert not f(3)"]),
    "lying_float_index": ("def f(x):\n    return 2 * x", "class F(float):\n    def __float__(s):\n        return 2.0\n    def __index__(s):\n        return 2\n    __eq__ = lambda s, o: True\n    __hash__ = float.__hash__\nclass I:\n    def __index__(s):\n        return 2\n    def __float__(s):\n        return 2.0\ndef f(x):\n    return F(-1.0) if x == 1 else I()", ["import math\nassert math.isclose(f(1), 2.0)", "assert [0, 0, 7][f(3) - 4] == 7"]),
    "changes_on_second_read": ("def f(x):\n    return [2 * x]", "class L(list):\n    n = 0\n    def __iter__(s):\n        L.n += 1\n        return iter([2] if L.n > 1 else [])\n    def __len__(s):\n        return 1\n    def __eq__(s, o):\n        L.n += 1\n        return L.n > 2\ndef f(x):\n    return L()", ["r = f(1)\nassert list(r) == [2]\nassert len(r) == 1\nassert r == [2]"]),
    "base_exception": ("def f(x):\n    return 2 * x", "class E(BaseException):\n    def __str__(s):\n        raise KeyboardInterrupt\ndef f(x):\n    raise E()", ["assert f(1) == 2"]),
    "exit_between_tests": ("def f(x):\n    return 2 * x", "import os\ndef f(x):\n    if x == 2:\n        os._exit(0)\n    return 2 * x", ["assert f(1) == 2", "assert f(2) == 4"]),
    "exit_in_finaliser": ("def f(x):\n    return [2 * x]", "import os\nclass L(list):\n    def __del__(s):\n        os._exit(0)\ndef f(x):\n    return L([-1])", ["assert f(1) == [2]"]),
    "protocol_lines_everywhere": ("def f(x):\n    return 2 * x", "import os, sys\nfor fd in range(64):\n    for line in (b'PASS 0\\n', b'PASS 1\\n', b'0 0 vJ1;2\\n0 d\\n'):\n        try:\n            os.write(fd, line)\n        except OSError:\n            pass\nprint('PASS 0')\nsys.stderr.write('PASS 0\\n')\ndef f(x):\n    return -1", ["assert f(1) == 2", "assert f(2) == 4"]),
    "signal_handler_frames": ("def f(x):\n    return 2 * x", "import signal, os\nfound = []\ndef h(signum, frame):\n    while frame is not None:\n        for v in list(frame.f_locals.values()):\n            if isinstance(v, str) and len(v) == 32:\n                found.append(v)\n        frame = frame.f_back\ntry:\n    signal.signal(signal.SIGALRM, h)\nexcept Exception:\n    try:\n        import importlib.util\n        m = importlib.util.module_from_spec(importlib.util.find_spec('_signal'))\n        m.signal(signal.SIGALRM, h)\n    except Exception:\n        pass\ndef f(x):\n    signal.raise_signal(signal.SIGALRM)\n    for fd in range(64):\n        for n in found:\n            for t in range(2):\n                try:\n                    os.write(fd, b'%s %d 0 vJ1;%d\\n%s %d d\\n' % (n.encode(), t, 2 * (t + 1), n.encode(), t))\n                except OSError:\n                    pass\n    return -1", ["assert f(1) == 2", "assert f(2) == 4"]),
    "stateful_by_call_count": ("def f(x, y):\n    return x + y", "n = [0]\ndef f(x, y):\n    n[0] += 1\n    return x + y if n[0] <= 3 else 0", ["import random\nfor _ in range(10):\n    x, y = random.randint(0, 99), random.randint(0, 99)\n    assert f(x, y) == x + y"]),
}
# Forgeries that score None (unscorable, not 1.0): they fail the test as written but pass
# Python's reading of it (the value it handed over, read back): the judge cannot tell them
# from an in-place update the test would check.
FORGED_UNSCORABLE = {"clear_input_later_statement"}
JUDGE_FORGERIES["changes_what_it_must_not"] = (
    "def f(d, k):\n    return d.get(k, 0)", "def f(d, k):\n    d.setdefault('x', 0)\n    return d.get(k, 0)",
    ["d = {'a': 1}\nassert f(d, 'a') == d['a']\nassert len(d) == 1"])
HONEST.append(("from dataclasses import dataclass\nimport enum\n@dataclass\nclass P:\n    x: int\n    y: int\nclass Color(enum.Enum):\n    RED = 1\n    BLUE = 2\ndef add(a, b):\n    return P(a.x + b.x, a.y + b.y)\ndef warm(p):\n    return Color.RED if p.x > 0 else Color.BLUE",
               ["assert add(P(1, 2), P(3, 4)) == P(4, 6)\nassert add(P(0, 0), P(0, 0)).x == 0", "assert warm(P(1, 0)) == Color.RED\nassert warm(P(-1, 0)) != Color.RED"]))
JUDGE_FORGERIES["dataclass_lying_eq"] = (
    "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\ndef add(a, b):\n    return P(a.x + b.x, a.y + b.y)",
    "from dataclasses import dataclass\n@dataclass(eq=False)\nclass P:\n    x: int\n    y: int\n    def __eq__(s, o):\n        return True\n    __hash__ = object.__hash__\ndef add(a, b):\n    return P(0, 0)",
    ["assert add(P(1, 2), P(3, 4)) == P(4, 6)"])
JUDGE_FORGERIES["empties_a_nested_list"] = (
    "def f(g):\n    return sum(map(len, g))", "def f(g):\n    g[0].clear()\n    return 0",
    ["g = [[1, 2], [3]]\nassert f(g) == len(g[0]) + len(g[1])"])
JUDGE_FORGERIES["global_named_like_the_expected"] = (
    "def f(x):\n    return 5", "expected = 0\ndef f(x):\n    global expected\n    expected = 0\n    return 0",
    ["expected = 5\nassert f(1) == expected"])


# Resource attacks: programs and answers that try to stall or flood the reward (see the docstring).
# HOSTILE_CODE: programs run against one test each (an assert on ``f`` where they define it, else
# stdin/stdout).
HOSTILE_CODE = {
    "colliding_hash_set": "M = (1 << 61) - 1\ndef f(x):\n    return {i * M for i in range(1, 200000)}",
    "colliding_hash_stdout": "M = (1 << 61) - 1\nimport sys\nfor i in range(1, 400000):\n    sys.stdout.write('%d\\n' % (i * M))",
    "huge_int": "def f(x):\n    return 7 ** 1000000",
    "deep_list": "def f(x):\n    v = []\n    for _ in range(10 ** 6):\n        v = [v]\n    return v",
    "wide_list": "def f(x):\n    return [0.5] * (5 * 10 ** 6)",
    "long_string": "def f(x):\n    return 'a' * (10 ** 8)",
    "stdout_flood": "import sys\nwhile True:\n    sys.stdout.write('2' * 65536)",
    "infinite_loop": "def f(x):\n    while True:\n        pass",
    "sleep": "import time\ntime.sleep(60)",
    "big_float_repr": "def f(x):\n    return [1e308, float('inf'), float('nan')] * 10 ** 5",
}
# The worst row: each against every test form below (what a row can cost the trainer).
WORST_PROGRAMS = {
    "sleep": "import time\ntime.sleep(600)\ndef f(*a): return 0",
    "busy_loop_in_call": "def f(*a):\n    while True:\n        pass",
    "exit_in_call": "import os\ndef f(*a):\n    os._exit(0)",
    "slow_generator": "import time\ndef f(*a):\n    def g():\n        while True:\n            time.sleep(0.01)\n            yield 1\n    return g()",
    "8MiB_of_tuples": "def f(*a):\n    return [(i,) for i in range(10 ** 6)]",
    "deep_recursion": "import sys\nsys.setrecursionlimit(10 ** 6)\ndef f(*a):\n    def d(n):\n        return d(n + 1)\n    return d(0)",
    "alarm_self": "import signal\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\ndef f(*a): return 0",
}
WORST_FORMS = {
    "plain asserts": (["assert f(1) == 2", "assert f(2) == 4"], None),
    "traced loop": (["import random\nfor _ in range(50):\n    x = random.randint(0, 99)\n    assert f(x) == 2 * x"], None),
    "trusted helper": (["def check(candidate):\n    assert candidate(double(3)) == 12\ncheck(f)"],
                       "def double(x: int):\n    return 2 * x\n"),
    "stdin/stdout": ([{"input": "1", "output": "2"}], None),
}
HOSTILE_MATH = [
    (r"10^{10^{10^{10}}}", "1"), (r"9^{9^{9^{9}}}", r"9^{9^{9^{9}}}"), ("(" * 500 + "1" + ")" * 500, "1"),
    ("1" * 1999, "1"), (r"\frac{" * 200 + "1" + "}{2}" * 200, "1"), ("x=" * 600 + "1", "1"),
    (r"100000!", "1"), (r"\sum_{k=1}^{10^{12}} k", "1"), (r"\int_0^1 e^{x^{x^{x}}} dx", "1"),
    ("1,\\!" * 400 + "1", "1"), (r"\sqrt{" * 30 + "2" + "}" * 30, r"\sqrt{2}"),
    ("; ".join(["(1, 2)"] * 300), "(1, 2)"),
]


# An answer that says yes to everything it can be asked (a float subclass: its value is -1.0).
LIAR = ("class Liar(float):\n    def __new__(cls):\n        return float.__new__(cls, -1.0)\n"
        + "".join(f"    def {m}(s, *a):\n        return {v}\n" for m, v in (
            ("__eq__", "True"), ("__ne__", "False"), ("__lt__", "True"), ("__le__", "True"),
            ("__gt__", "True"), ("__ge__", "True"), ("__bool__", "True"), ("__len__", "0"),
            ("__float__", "0.0"), ("__index__", "0"), ("__hash__", "0"), ("__abs__", "0.0"),
            ("__contains__", "True"), ("__iter__", "iter(())"), ("__str__", "''"), ("__sub__", "0.0"))))
# Lines that look like every verdict protocol, on every descriptor and stdout, then an exit.
PROTOCOL_PRINTER = ("import os, sys\nfor fd in range(64):\n    for t in range(64):\n        try:\n"
                    "            os.write(fd, b'PASS %d\\nPYTH %d\\n%d D\\n' % (t, t, t))\n"
                    "        except OSError:\n            pass\nprint('PASS 0')\nos._exit(0)\n")
