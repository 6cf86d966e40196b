"""One assert test split between the judge and the program's process (:class:`Planner`), and the judge's
sources built from that split: the test as written and its Python reading, a traced test's step runs
hoisted, and the judge's first stage. :mod:`grpo.rewards.sandbox` says how a verdict is reached;
:mod:`.assert_plan` plans a completion's tests with it.
"""

from __future__ import annotations

import ast
import copy
import sys

from .policy import BUILTIN_NAMES, JUDGE_BUILTINS, judge_import, stateful_import

PROBE = "__grpo_probe__"
INPUT = "__grpo_in%d__"  # a value the judge computed, bound inside before a step runs
AT, VAL, STEP = "__grpo_at__", "__grpo_val__", "__grpo_step__"
DUAL = "__grpo_dual__"  # (the judge's copy, the sandbox's copy) of a value handed to the program
_HANDOFF = {"fresh": 0, "probe": 1, "stmt": 2}  # how far the program has had a mirrored name
# Constructs that are test logic: inside the program's process their outcome would be the
# program's to decide, so code that runs there (setup, probes) may not hold them.
_LOGIC = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.ListComp, ast.SetComp,
          ast.DictComp, ast.GeneratorExp, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)


class Refused(Exception):
    """A test whose verdict could not be reached outside the program's process."""


class _Handed(Refused):
    """The test reads a value again after handing it to a statement of the program."""


def _names_loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _free_names(node: ast.AST) -> set[str]:
    """Names ``node`` reads from outside it (its own comprehensions' and lambdas' names left out)."""
    bound: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            bound |= {x.id for x in ast.walk(n.target) if isinstance(x, ast.Name)}
        elif isinstance(n, ast.Lambda):
            bound |= {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
    return _names_loaded(node) - bound


def _target_names(t: ast.AST) -> set[str] | None:
    """Names bound by a plain assignment target, None for subscripts / attributes."""
    if isinstance(t, ast.Name):
        return {t.id}
    if isinstance(t, (ast.Tuple, ast.List)):
        out: set[str] = set()
        for e in t.elts:
            sub = _target_names(e.value if isinstance(e, ast.Starred) else e)
            if sub is None:
                return None
            out |= sub
        return out
    return None


def _statements(body: list) -> list:
    """Every statement of ``body``, those in its loops' and ifs' bodies included."""
    out = []
    for st in body:
        out.append(st)
        if isinstance(st, (ast.For, ast.If, ast.While)):
            out.extend(_statements(st.body) + _statements(st.orelse))
    return out


def _marker(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def _is_call_of(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


class Planner:
    """Splits each assert test into harness logic and program-controlled probes.

    An expression is *H* (the judge computes it: constants, the judge's builtins and modules,
    names the test binds to judge-side values, the test's own lambdas and comprehensions, the
    trusted helpers), *P* (the program's: its names and what is called, indexed by attribute
    or called on them) or *M* (judge logic over P parts). Every P part directly under judge
    logic becomes a probe: evaluated inside, its value leaves as plain data, and comparisons,
    membership, ``count``, ``isinstance`` ... run in the judge on that data.

    Some values exist only in the judge (*judge-only*): what the trusted helpers and the
    stateful modules (``random``) compute, and the names a test binds to such values or binds
    in its own loops. A part of a probe or of a statement of the program that reads them is
    computed in the judge and *sent* in: replaced by an input name the sandbox binds before the
    step runs. A test with such inputs, or with steps inside its own loops or ifs, is *traced*:
    the judge runs its judge side first and records every step run (``AssertPlan.pre``).

    A name the test binds at top level to a judge-side value that a step of the program reads
    is *mirrored* (``mirror``): the judge's assignment and the same assignment inside (in the
    test's own namespace there); the judge's reads use its copy, and after a step of the
    program had the name, ``__grpo_dual__(judge copy, read-back probe)`` (a probe) or the
    read-back alone (a statement) -- see the module docstring. A name bound to the program's
    value (``pvalued``) lives inside; calls, attributes and indexing on it are P.
    """

    def __init__(self, program_names: set[str], tests: list[ast.Module],
                 trusted: frozenset = frozenset()):
        self.shadowed = program_names
        self.tests = tests
        self.test_names: set[str] = set()  # names test assignments bind
        self.judge_imports: set[str] = set()
        self.foreign: set[str] = set()  # names the tests' imports of other modules bind
        self.stateful: set[str] = set()  # names bound by the tests' imports of STATEFUL_MODULES
        for tree in tests:
            for st in _statements(tree.body):
                if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                        self.test_names |= _target_names(t) or set()
                elif isinstance(st, (ast.Import, ast.ImportFrom)):
                    bound = {(a.asname or a.name).partition(".")[0] for a in st.names}
                    if judge_import(st):
                        self.judge_imports |= bound
                        if stateful_import(st):
                            self.stateful |= bound
                    else:
                        self.foreign |= bound
        # A name the tests bind themselves is theirs, not the trusted helper's.
        self.trusted = frozenset(trusted) - self.test_names
        self.inside_needed: set[str] = set()
        # Test names bound to the program's values (r = f(1), s = Stack()): what the test
        # calls, reads or indexes on them is the program's, evaluated inside.
        self.pvalued: set[str] = set()
        self.vector: dict | None = None  # the enclosing single-generator comprehension
        self._reset()

    def _reset(self) -> None:
        self.steps: list = []
        self.probes: list = []
        self.vector = None
        self.jnames: set[str] = set()  # this test's judge-only names (its loops', and those bound to judge-only values)
        self.handed: set[str] = set()  # judge-only names handed to a statement of the program
        self.inputs: dict[int, list] = {}  # step -> [(input name, judge-side expression)]
        self.probe_step: dict[int, int] = {}  # probe id -> step
        self.cur_inputs: list = []
        self.depth = 0  # inside the test's own loops / ifs
        self.traced = False
        # Test names bound at top level to judge-side values that the program reads: the
        # judge keeps its copy, the sandbox its own. State: "fresh" (no step of the program
        # has had it since), "probe" (a probe or value-producing statement of the program
        # had it: the judge reads its copy, the Python reading the sandbox's), "stmt" (a
        # statement of the program had it: the test checks what the program did to it, read
        # back from the sandbox). Handoffs in a top-level statement count from the next one.
        self.mirror: dict[str, str] = {}
        self.pending: dict[str, str] = {}
        self.duals = False
        self.foreign_t: set[str] = set(self.foreign)  # plus names bound from such modules' values

    # ---- classification -----------------------------------------------------------------
    def judge_name(self, name: str, local: frozenset) -> bool:
        if name in local:
            return True
        if name in self.mirror:
            return self.mirror[name] != "stmt"
        if name in self.jnames:
            if name in self.handed:
                raise _Handed(f"the test reads {name} after handing it to a statement of the "
                              "program (changes made in place would not be seen)")
            return True
        if name in self.trusted:
            return True  # the problem's own helper: defined in the judge, never the program's
        if name in self.shadowed:
            if name in JUDGE_BUILTINS or name == "math" or name in self.judge_imports:
                # The test's logic would call the program's version of a builtin: refused.
                raise Refused(f"the program redefines {name}, which the test uses")
            return False
        if name in self.test_names:
            return name not in self.inside_needed
        return name in JUDGE_BUILTINS or name in self.judge_imports or name == "math"

    def on_program_value(self, node: ast.AST, local: frozenset) -> bool:
        """``r.upper()``, ``s.pop()``, ``r[0]``, ``r()`` where ``r`` is a test name bound to
        a value of the program: the program's object does it, inside."""
        base = node.func if isinstance(node, ast.Call) else node.value
        return (isinstance(base, ast.Name) and base.id in self.pvalued and base.id not in local
                and base.id not in self.mirror and base.id not in self.jnames)

    def program_part(self, node: ast.AST, local: frozenset) -> bool:
        """Whether ``node`` is a value of the program: a name of its, or what is called,
        indexed or read as an attribute on one."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        if not isinstance(node, ast.Name):
            return False
        if node.id in self.pvalued and node.id not in local:
            return True
        try:
            return not self.judge_name(node.id, local)
        except Refused:
            return False

    def compared_inside(self, node: ast.Compare, local: frozenset) -> bool:
        """An identity test between non-constants where a side is the program's (``f(xs) is
        xs``, ``s.top() is not s.pop()``) is evaluated inside, as one probe: identity exists
        only there, and ``is`` cannot be overridden (no object's method takes part). Every
        other comparison runs in the judge, on the values."""
        operands = [node.left] + node.comparators
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            return False
        if any(isinstance(o, ast.Constant) for o in operands):
            return False
        return (any(self.program_part(o, local) for o in operands)
                and all(self.program_part(o, local) or isinstance(o, ast.Name) and o.id in self.mirror
                        for o in operands))

    def handoff(self, node: ast.AST, kind: str) -> None:
        """A step of the program (``kind``: "probe" or "stmt") reads the mirrored names in
        ``node``: from the next top-level statement on (at once inside the test's loops and
        ifs), the judge's reads of them follow that (see ``mirror``)."""
        for name in _names_loaded(node) & set(self.mirror):
            if _HANDOFF[kind] > _HANDOFF[self.pending.get(name, "fresh")]:
                self.pending[name] = kind
        if self.depth:
            self.settle()

    def settle(self) -> None:
        for name, kind in self.pending.items():
            if name in self.mirror and _HANDOFF[kind] > _HANDOFF[self.mirror[name]]:
                self.mirror[name] = kind
        self.pending = {}

    def prescan(self, body: list) -> None:
        """Before a top-level loop or if: the handoffs its body makes, by form, count from its
        first statement (a later iteration reads what an earlier one handed over)."""
        live = {n for n, k in self.mirror.items() if k != "stmt"}
        for st in _statements(body):
            if isinstance(st, (ast.For, ast.If, ast.While)):
                continue
            names = set()
            for n in ast.walk(st):
                if isinstance(n, ast.Call) and self.program_part(n.func, frozenset()):
                    names |= _names_loaded(n) & live
            if not names:
                continue
            effect = isinstance(st, ast.Expr) or isinstance(st, (ast.Assign, ast.AugAssign)) and any(
                isinstance(t, (ast.Subscript, ast.Attribute))
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]))
            for name in names:
                self.pending[name] = "stmt" if effect else max(
                    "probe", self.pending.get(name, "probe"), key=_HANDOFF.__getitem__)
        self.settle()

    def judge_only_names(self) -> set[str]:
        return self.trusted | self.stateful | self.jnames

    def is_h(self, node: ast.AST) -> bool:
        """Whether the judge computes ``node`` (no name of the program in it); never refuses,
        except for a name the test reads after handing it to the program."""
        if any(isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom))
               or isinstance(n, (ast.Attribute, ast.Subscript, ast.Call))
               and self.on_program_value(n, frozenset()) for n in ast.walk(node)):
            return False
        try:
            return all(self.judge_name(n, frozenset()) for n in _free_names(node))
        except _Handed:
            raise
        except Refused:
            return False

    def expr(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """(kind, node): P nodes come back as they are, H/M nodes rewritten for the judge."""
        if isinstance(node, ast.Constant):
            return "H", node
        if isinstance(node, ast.Name):
            if node.id not in local and self.mirror.get(node.id) == "probe":
                # The judge's copy as written; the sandbox's, read back now, for the Python
                # reading (AssertPlan.python).
                self.duals = True
                return "H", _marker(DUAL, ast.Name(node.id, ast.Load()),
                                    self.probe(node, local, handoff=False))
            return ("H" if self.judge_name(node.id, local) else "P"), node
        if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            raise Refused(f"{type(node).__name__} in a test")
        if isinstance(node, ast.Compare) and self.compared_inside(node, local):
            return "P", node
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)) and self.on_program_value(node, local):
            return "P", node
        if isinstance(node, ast.Attribute):
            k, v = self.expr(node.value, local)
            if k == "P":
                return "P", node
            return k, ast.Attribute(v, node.attr, ast.Load())
        if isinstance(node, ast.Call):
            kf, f = self.expr(node.func, local)
            if kf == "P":
                return "P", node
            kinds, args, keywords = [kf], [], []
            for a in node.args:
                k, v = self.child(a, local)
                kinds.append(k)
                args.append(v)
            for kw in node.keywords:
                k, v = self.child(kw.value, local)
                kinds.append(k)
                keywords.append(ast.keyword(kw.arg, v))
            return _mix(kinds), ast.Call(f, args, keywords)
        if isinstance(node, ast.Lambda):
            inner = local | {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            k, body = self.child(node.body, frozenset(inner))
            return k, ast.Lambda(node.args, body)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self.comprehension(node, local)
        # Every other expression is judge logic over its children.
        kinds: list[str] = []

        def rebuild(value):
            if isinstance(value, ast.expr) and not isinstance(value, ast.expr_context):
                k, v = self.child(value, local)
                kinds.append(k)
                return v
            if isinstance(value, list):
                return [rebuild(x) for x in value]
            if isinstance(value, ast.keyword):
                return ast.keyword(value.arg, rebuild(value.value))
            return value

        fields = {name: rebuild(getattr(node, name)) for name in node._fields}
        return _mix(kinds), type(node)(**fields)

    def comprehension(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """The test's own comprehension runs in the judge. With one generator, a program part
        that reads its variable becomes a *vector probe*: ``[part for target in iter]``
        evaluated inside, read back by position (``enumerate`` in the judge)."""
        if any(g.is_async for g in node.generators):
            raise Refused("async comprehension in a test")
        kinds, gens, inner = [], [], set(local)
        saved = self.vector
        single = len(node.generators) == 1
        index = "__grpo_i%d__" % len(local)
        for g in node.generators:
            names = _target_names(g.target)
            if names is None:
                raise Refused("comprehension target that is not a name")
            ki, it = self.child(g.iter, frozenset(inner))
            kinds.append(ki)
            self.vector = ({"vars": names, "outer": frozenset(inner), "target": g.target,
                            "iter": g.iter, "index": index, "used": False} if single else None)
            inner |= names
            ifs = []
            for c in g.ifs:
                kc, vc = self.child(c, frozenset(inner))
                kinds.append(kc)
                ifs.append(vc)
            gens.append([g.target, it, ifs])
        fz = frozenset(inner)
        if isinstance(node, ast.DictComp):
            kk, key = self.child(node.key, fz)
            kv, val = self.child(node.value, fz)
            kinds += [kk, kv]
        else:
            ke, elt = self.child(node.elt, fz)
            kinds.append(ke)
        vector, self.vector = self.vector, saved
        # (the ifs of the single generator were planned with its vector context too)
        comps = [ast.comprehension(_as_store(t), it, ifs, 0) for t, it, ifs in gens]
        if single and vector["used"]:
            t, it, ifs = gens[0]
            comps = [ast.comprehension(ast.Tuple([ast.Name(index, ast.Store()), _as_store(t)],
                                                 ast.Store()),
                                       ast.Call(ast.Name("enumerate", ast.Load()), [it], []), ifs, 0)]
        if isinstance(node, ast.DictComp):
            return _mix(kinds), ast.DictComp(key, val, comps)
        return _mix(kinds), type(node)(elt, comps)

    def child(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """A child of judge logic: a P child becomes a probe (H / M after this)."""
        k, v = self.expr(node, local)
        if k != "P":
            return k, v
        return "M", self.probe(node, local)

    def ship(self, node: ast.AST, local: frozenset = frozenset(), inner: frozenset = frozenset(),
             per_element: bool = False, handing: bool = False) -> ast.AST:
        """``node`` (to be evaluated inside) with its judge-only parts replaced by input names,
        their judge-side expressions kept in ``cur_inputs``. ``local``: the test's own
        comprehension / lambda names around it (a part reading them is not sent: it is refused
        where it is read); ``inner``: names ``node`` binds itself (its own comprehensions,
        evaluated inside); ``per_element``: ``node`` runs once per element of a comprehension,
        where a value sent once could not stand for a call made each time; ``handing``:
        ``node`` belongs to a statement of the program (``handed``)."""
        if not isinstance(node, ast.expr):
            return node
        free = _free_names(node) - local
        if not (free & self.judge_only_names()):
            return node  # nothing judge-only: unchanged (as before traced tests existed)
        storing = isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))
        if not storing and not (_free_names(node) & (local | inner)) and self.is_h(node):
            if per_element and any(isinstance(n, ast.Call) for n in ast.walk(node)):
                raise Refused("a value the judge would compute for each element of a "
                              "comprehension would be passed to the program")
            name = INPUT % len(self.cur_inputs)
            self.cur_inputs.append((name, node))
            if handing and not isinstance(node, ast.Call):
                self.handed |= _names_loaded(node) & self.jnames
            return ast.copy_location(ast.Name(name, ast.Load()), node)
        if storing and isinstance(node, ast.Name) and node.id in self.jnames:
            raise Refused(f"a statement of the program would bind {node.id}, which the test "
                          "computes in the judge")
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            scope, gens = set(inner), []
            for k, g in enumerate(node.generators):
                it = self.ship(g.iter, local, frozenset(scope), per_element or k > 0, handing)
                scope |= {x.id for x in ast.walk(g.target) if isinstance(x, ast.Name)}
                ifs = [self.ship(c, local, frozenset(scope), True, handing) for c in g.ifs]
                gens.append(ast.comprehension(g.target, it, ifs, g.is_async))
            fz = frozenset(scope)
            if isinstance(node, ast.DictComp):
                return ast.DictComp(self.ship(node.key, local, fz, True, handing),
                                    self.ship(node.value, local, fz, True, handing), gens)
            return type(node)(self.ship(node.elt, local, fz, True, handing), gens)
        if isinstance(node, ast.Lambda):
            args = frozenset(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
            return ast.Lambda(node.args, self.ship(node.body, local, inner | args, True, handing))

        def rebuild(value):
            if isinstance(value, ast.expr) and not isinstance(value, ast.expr_context):
                return self.ship(value, local, inner, per_element, handing)
            if isinstance(value, list):
                return [rebuild(x) for x in value]
            if isinstance(value, ast.keyword):
                return ast.keyword(value.arg, rebuild(value.value))
            return value

        return type(node)(**{f: rebuild(getattr(node, f)) for f in node._fields})

    def add_step(self, step: list) -> int:
        """Append a step of the program (inputs from ``cur_inputs``); returns its index."""
        sid = len(self.steps)
        self.steps.append(step)
        if self.cur_inputs:
            self.inputs[sid] = self.cur_inputs
        if self.cur_inputs or self.depth:
            self.traced = True
        self.cur_inputs = []
        return sid

    def probe(self, node: ast.AST, local: frozenset, handoff: bool = True) -> ast.AST:
        root = node
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in self.foreign_t:
            raise Refused(f"the test's logic uses {root.id}, from a module the judge does not "
                          "run (inside, the program could patch it)")
        if handoff:
            self.handoff(node, "probe")
        v = self.vector
        pid = len(self.probes)
        self.cur_inputs = []
        if v is not None and _names_loaded(node) & v["vars"]:
            # A vector probe: the part for every element of the comprehension's iterable.
            node = self.ship(node, local - v["vars"], frozenset(v["vars"]), True)
            it = self.ship(v["iter"], v["outer"], frozenset(), bool(v["outer"]))
            self.reads(node, v["outer"])
            self.reads(it, v["outer"])
            if _names_loaded(node) & (local - v["vars"] - v["outer"]):
                raise Refused("a value of the test's own lambda would be passed to the program")
            # The same form as the judge's loop (``enumerate(<iterable>)``), under the same
            # PYTHONHASHSEED: a set display iterates alike on both sides (a bare ``for x in
            # {...}`` would iterate a frozenset constant, in another order).
            enum = ast.Call(ast.Name("enumerate", ast.Load()), [it], [])
            target = ast.Tuple([ast.Name(v["index"], ast.Store()), _as_store(v["target"])], ast.Store())
            source = ast.unparse(ast.ListComp(node, [ast.comprehension(target, enum, [], 0)]))
            v["used"] = True
            self.probes.append(source)
            self.probe_step[pid] = self.add_step(["probe", pid, source])
            return ast.Subscript(ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(pid)], []),
                                 ast.Name(v["index"], ast.Load()), ast.Load())
        node = self.ship(node, local, frozenset(), bool(local))
        self.reads(node, local)
        self.probes.append(ast.unparse(node))
        self.probe_step[pid] = self.add_step(["probe", pid, self.probes[-1]])
        return ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(pid)], [])

    def inside(self, node: ast.AST, local: frozenset = frozenset()) -> None:
        """``node`` runs in the program's process: no test logic in it, no judge-local names;
        the test names it reads must exist there."""
        for n in ast.walk(node):
            if isinstance(n, _LOGIC) or (isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not)):
                raise Refused(f"test logic ({type(n).__name__}) would run in the program's process")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in BUILTIN_NAMES \
                    and n.func.id not in self.shadowed and any(
                        not self.judge_only(a) for a in n.args + [k.value for k in n.keywords]):
                raise Refused(f"builtin {n.func.id}() over the program's values would run in its process")
        self.reads(node, local)

    def reads(self, node: ast.AST, local: frozenset) -> None:
        """``node`` is evaluated inside (a probe's value is the program's whatever it holds)."""
        used = _names_loaded(node)
        if used & local:
            raise Refused("a value of the test's own loop or lambda would be passed to the program")
        self.inside_needed |= used & self.test_names

    def judge_only(self, node: ast.AST) -> bool:
        """Whether ``node`` reads nothing of the program (constants and judge names only)."""
        return all(n in self.test_names or self.judge_name(n, frozenset())
                   for n in _names_loaded(node))

    # ---- statements -----------------------------------------------------------------------
    def plan(self, tree: ast.Module) -> tuple[list, str, str | None, dict, str | None]:
        """(inside steps, judge source, first-stage source or None, step inputs, Python
        reading or None) of one test; raises Refused with ``self.at`` the index of the refused
        top-level statement."""
        self._reset()
        judge: list[ast.stmt] = []
        for k, st in enumerate(tree.body):
            self.at = k
            judge.extend(self.statement(st))
            self.settle()
        self.at = None
        if not self.probes and _names_loaded(tree) & self.trusted:
            raise Refused("the test reads nothing of the program: trusted_code defines "
                          "every function it calls")

        def source(body: list) -> str:
            return ast.unparse(ast.fix_missing_locations(ast.Module(body=body or [ast.Pass()],
                                                                    type_ignores=[])))

        if not self.traced:
            strict, python = _readings(_strip_steps(judge), self.duals)
            return self.steps, source(strict), None, {}, python and source(python)
        strict, python = _readings(_hoist(judge, self.inputs, self.probe_step), self.duals)
        pre = _first_stage(copy.deepcopy(strict), set(), self.stateful)
        steps = [[s[0], s[-1], [name for name, _ in self.inputs.get(sid, [])]]
                 for sid, s in enumerate(self.steps)]
        return steps, source(strict), source(pre), self.inputs, python and source(python)

    def statement(self, st: ast.stmt) -> list[ast.stmt]:
        """The judge's statements for ``st`` (a step of the program leaves a ``__grpo_step__``
        marker where it runs)."""
        if isinstance(st, ast.Assert):
            k, test = self.child(st.test, frozenset())
            return [ast.Assert(test, None)]
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            for top in _imported_modules(st):
                if top not in _STDLIB:
                    raise Refused(f"the test imports {top}, which the sandbox does not have "
                                  "(the standard library only)")
            out = [self.step_marker(["exec", ast.unparse(st)])]
            if judge_import(st):
                out.append(st)
            else:
                self.foreign_t |= {(a.asname or a.name).partition(".")[0] for a in st.names}
            return out
        if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return self.assignment(st)
        if isinstance(st, ast.Expr):
            call = st.value
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "print" and "print" not in self.shadowed):
                # print's arguments go nowhere the judge reads: run it (for the calls'
                # effects), exempt from the rule on builtins.
                call = self.ship(call, handing=True)
                self.reads(call, frozenset())
                if not self.is_h(call):
                    self.handoff(call, "stmt")
                return [self.step_marker(["exec", ast.unparse(ast.Expr(call))])]
            mirrored = _free_names(call) & set(self.mirror)
            if self.is_h(call) and mirrored:
                # The test's own call on a value the program also holds (xs.append(4)): run in
                # the judge on its copy and in the sandbox on the program's, alike.
                if _free_names(call) & self.judge_only_names():
                    return [st] + self.resend(mirrored)
                _, judged = self.child(call, frozenset())
                return [ast.Expr(judged), self.step_marker(["exec", ast.unparse(ast.Expr(call))])]
            if _free_names(call) & self.judge_only_names() and self.is_h(call):
                return [st]  # a call on judge-side values (xs.append(x), random.seed(1)): the judge's
            call = self.ship(call, handing=True)
            self.inside(call)
            self.handoff(call, "stmt")
            return [self.step_marker(["exec", ast.unparse(ast.Expr(call))])]
        if isinstance(st, ast.For) and not st.orelse:
            if self.depth == 0:
                self.prescan(st.body)
            if self.depth == 0 and all(isinstance(b, (ast.Assert, ast.Pass)) for b in st.body) \
                    and not _free_names(st) & self.judge_only_names():
                return [self.loop(st)]
            return [self.judge_loop(st)]
        if isinstance(st, ast.If):
            if not self.is_h(st.test):
                raise Refused("an if on the program's values in a test")
            if self.depth == 0:
                self.prescan(st.body + st.orelse)
            self.depth += 1
            body = [s for b in st.body for s in self.statement(b)]
            orelse = [s for b in st.orelse for s in self.statement(b)]
            self.depth -= 1
            return [ast.If(st.test, body or [ast.Pass()], orelse)]
        if isinstance(st, (ast.Break, ast.Continue)) and self.depth:
            return [st]
        if isinstance(st, ast.Pass):
            return []
        raise Refused(f"{type(st).__name__} statement in a test (only asserts, "
                      "assignments, imports, calls, loops and ifs are judged)")

    def resend(self, names: set) -> list[ast.stmt]:
        """After a judge-only statement changed mirrored names (``xs.append(random...)``):
        the sandbox's copies are replaced by the judge's, sent in (a traced step)."""
        out = []
        for name in sorted(names):
            self.cur_inputs = [(INPUT % 0, ast.Name(name, ast.Load()))]
            out.append(self.step_marker(["exec", f"{name} = {INPUT % 0}"]))
            self.mirror[name] = "fresh"
            self.pending.pop(name, None)
        return out

    def step_marker(self, step: list) -> ast.stmt:
        return ast.Expr(_marker(STEP, ast.Constant(self.add_step(step))))

    def loop(self, st: ast.For) -> ast.stmt:
        """``for t in iter: assert ...`` in the judge, its program parts as vector probes."""
        names = _target_names(st.target)
        if names is None:
            raise Refused("loop target that is not a name")
        _, it = self.child(st.iter, frozenset())
        index = "__grpo_i0__"
        self.vector = {"vars": names, "outer": frozenset(), "target": st.target,
                       "iter": st.iter, "index": index, "used": False}
        body = []
        for b in st.body:
            if isinstance(b, ast.Assert):
                body.append(ast.Assert(self.child(b.test, frozenset(names))[1], None))
        vector, self.vector = self.vector, None
        target, it_ = _as_store(st.target), it
        if vector["used"]:
            target = ast.Tuple([ast.Name(index, ast.Store()), target], ast.Store())
            it_ = ast.Call(ast.Name("enumerate", ast.Load()), [it], [])
        return ast.For(target, it_, body or [ast.Pass()], [], None)

    def judge_loop(self, st: ast.For) -> ast.stmt:
        """A loop of the test's own that runs in the judge (its body assigns, calls, nests
        loops or ifs, or reads judge-only values): its target and what its body binds to
        judge-side values are judge-only names; each step of the program in it runs once per
        iteration, with the values it reads sent in (a traced test)."""
        names = _target_names(st.target)
        if names is None:
            raise Refused("loop target that is not a name")
        if not self.is_h(st.iter):
            raise Refused("a loop over the program's values whose body is more than asserts")
        self.jnames |= names
        self.handed -= names
        self.depth += 1
        body = [s for b in st.body for s in self.statement(b)]
        self.depth -= 1
        loop = ast.For(_as_store(st.target), st.iter, body or [ast.Pass()], [], None)
        loop.grpo_judge_loop = True
        return loop

    def assignment(self, st: ast.stmt) -> list[ast.stmt]:
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        value = st.value
        if value is None:  # a bare annotation
            return []
        names = [_target_names(t) for t in targets]
        if any(n is None for n in names):  # d[k] = v, o.a = v: a mutation of program state
            into = [t for t in targets if isinstance(t, (ast.Subscript, ast.Attribute))]
            mirrored = {n for t in into for n in _names_loaded(t.value) if n in self.mirror
                        and self.mirror[n] != "stmt"}
            if mirrored and all(self.is_h(t.value) for t in into) and self.is_h(value):
                # xs[0] = 5 on a value the test and the program both hold: in both places
                # (or, with a value only the judge computes, the judge's copy sent in again).
                if _free_names(st) & self.judge_only_names():
                    return [st] + self.resend(mirrored)
                _, judged = self.child(value, frozenset())
                self.reads(st, frozenset())
                return [type(st)(**{**{f: getattr(st, f) for f in st._fields}, "value": judged}),
                        self.step_marker(["exec", _stmt_source(st)])]
            if any(isinstance(t, (ast.Subscript, ast.Attribute)) and _names_loaded(t) & self.jnames
                   and self.is_h(t.value) for t in targets):
                if self.is_h(value):
                    return [st]  # xs[i] = v on the test's own judge-side values
                raise Refused("an assignment into a judge-side value from the program's")
            st = _ship_stmt(self, st)
            self.inside(st)
            self.handoff(st, "stmt")
            return [self.step_marker(["exec", ast.unparse(st)])]
        bound = set().union(*names)
        if isinstance(st, ast.AugAssign):
            value = ast.BinOp(ast.Name(st.target.id, ast.Load()), st.op, value)
            targets = [ast.Name(st.target.id, ast.Store())]
        if (self.depth or _free_names(value) & self.judge_only_names()) and self.is_h(value):
            # A value only the judge computes (or one computed in the test's own loop): a
            # judge-only name, sent to the program where a step reads it.
            self.jnames |= bound
            self.handed -= bound
            self.drop_mirror(bound)
            return [ast.Assign([_as_store(t) for t in targets], value, None)]
        if bound & self.inside_needed:
            # The program reads these names: bind them inside.
            if not bound <= self.inside_needed:
                raise Refused("an assignment binds names both the program and the judge need")
            if self.depth == 0 and self.is_h(value) and _mirrorable(value):
                # A judge-side value: the judge computes its own copy (what it reads), the
                # sandbox binds the program's (with the builtins as they were before the
                # program ran). Whatever the program does to its copy -- in place, or by
                # rebinding the name with a global statement -- the judge's is untouched.
                _, judged = self.child(value, frozenset())
                self.reads(value, frozenset())
                self.jnames -= bound
                for name in bound:
                    self.mirror[name] = "fresh"
                    self.pending.pop(name, None)
                return [ast.Assign([_as_store(t) for t in targets], judged, None),
                        self.step_marker(["exec", _stmt_source(ast.Assign(targets, value, None))])]
            value = self.ship(value, handing=True)
            self.inside(value)
            self.handoff(value, "probe")
            self.drop_mirror(bound)
            if not self.is_h(value):
                self.pvalued |= bound
            return [self.step_marker(["exec", _stmt_source(ast.Assign(targets, value, None))])]
        k, v = self.child(value, frozenset())
        self.jnames -= bound
        self.drop_mirror(bound)
        if k != "H":
            self.pvalued |= bound
        return [ast.Assign([_as_store(t) for t in targets], v, None)]

    def drop_mirror(self, names: set) -> None:
        for name in names:
            self.mirror.pop(name, None)
            self.pending.pop(name, None)


class _Reading(ast.NodeTransformer):
    """``__grpo_dual__(judge copy, sandbox copy)`` -> the one or the other."""

    def __init__(self, python: bool):
        self.python = python

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if _is_call_of(node, DUAL):
            return self.visit(node.args[1] if self.python else node.args[0])
        return self.generic_visit(node)


def _readings(stmts: list, duals: bool) -> tuple[list, list | None]:
    """(the test as written, on its own copies; its Python reading, or None without duals)."""
    strict = [_Reading(False).visit(copy.deepcopy(st)) for st in stmts]
    python = [_Reading(True).visit(copy.deepcopy(st)) for st in stmts] if duals else None
    return strict, python


def _mirrorable(value: ast.AST) -> bool:
    """A judge-side value the sandbox may compute for itself: no function of the test's own
    (a lambda would hand the program the test's namespace), nothing that suspends."""
    return not any(isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom))
                   for n in ast.walk(value))


def _imported_modules(st: ast.stmt) -> set[str]:
    if isinstance(st, ast.Import):
        return {a.name.partition(".")[0] for a in st.names}
    return {(st.module or "").partition(".")[0]} if st.level == 0 else {""}


# What the sandbox can import: the standard library (its interpreter runs without site).
_STDLIB = frozenset(sys.stdlib_module_names)


def _ship_stmt(planner: Planner, st: ast.stmt) -> ast.stmt:
    """A statement of the program with its judge-only parts sent in (``Planner.ship``)."""
    def rebuild(value):
        if isinstance(value, ast.expr):
            return planner.ship(value, handing=True)
        if isinstance(value, list):
            return [rebuild(x) for x in value]
        return value

    return type(st)(**{f: rebuild(getattr(st, f)) for f in st._fields})


def _strip_steps(stmts: list) -> list:
    """An untraced test's judge statements without the step markers."""
    out = []
    for st in stmts:
        if isinstance(st, ast.Expr) and _is_call_of(st.value, STEP):
            continue
        if isinstance(st, (ast.For, ast.If)):
            st.body = _strip_steps(st.body) or [ast.Pass()]
            st.orelse = _strip_steps(st.orelse)
        out.append(st)
    return out


class _ProbesToRuns(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call) -> ast.AST:
        if _is_call_of(node, PROBE):
            return _marker(VAL, ast.Name("__grpo_h%d__" % node.args[0].value, ast.Load()))
        return self.generic_visit(node)


def _run_marker(sid: int, is_exec: bool, inputs: dict) -> ast.Call:
    """``__grpo_at__(step, is_statement, lambda: (inputs,))``: the next step run."""
    exprs = [e for _, e in inputs.get(sid, [])]
    thunk = (ast.Lambda(ast.arguments([], [], None, [], [], None, []),
                        ast.Tuple(exprs, ast.Load())) if exprs else ast.Constant(None))
    return _marker(AT, ast.Constant(sid), ast.Constant(is_exec), thunk)


def _hoist(stmts: list, inputs: dict, probe_step: dict) -> list:
    """A traced test's judge statements: before each statement, one ``__grpo_at__`` per step
    run it makes (its probes in order; a statement of the program where it ran), so that
    both judge stages meet the steps in the same order whatever the asserts short-circuit;
    the probes then read ``__grpo_val__`` of their run."""
    out: list[ast.stmt] = []
    for st in stmts:
        if isinstance(st, ast.Expr) and _is_call_of(st.value, STEP):
            out.append(ast.Expr(_run_marker(st.value.args[0].value, True, inputs)))
            continue
        if isinstance(st, ast.For) and getattr(st, "grpo_judge_loop", False):
            loop = ast.For(st.target, st.iter, _hoist(st.body, inputs, probe_step) or [ast.Pass()], [], None)
            loop.grpo_judge_loop = True
            out.append(loop)
            continue
        if isinstance(st, ast.If):
            out.append(ast.If(st.test, _hoist(st.body, inputs, probe_step) or [ast.Pass()],
                              _hoist(st.orelse, inputs, probe_step)))
            continue
        # A simple statement, or a loop of asserts whose probes are vectors: every probe in it
        # runs once, before it.
        pids = sorted({n.args[0].value for n in ast.walk(st) if _is_call_of(n, PROBE)})
        for pid in pids:
            out.append(ast.Assign([ast.Name("__grpo_h%d__" % pid, ast.Store())],
                                  _run_marker(probe_step[pid], False, inputs), None))
        out.append(_ProbesToRuns().visit(st))
    return out


def _untainted(node: ast.AST, tainted: set, what: str) -> None:
    if _names_loaded(node) & tainted or any(_is_call_of(n, VAL) for n in ast.walk(node)):
        raise Refused(f"{what} would depend on the program's output (a test that feeds the "
                      "program's values back to it, or loops on them, is not judged)")


def _first_stage(stmts: list, tainted: set, stateful: set) -> list:
    """The judge's first stage of a traced test (run before the program): its asserts and the
    statements over the program's values (*tainted*: what a probe returned, and every name
    such a statement binds or calls a method of) left out, every step run kept. Refused when
    a step's inputs, a loop's iterable or an if's test would read a tainted name."""
    out: list[ast.stmt] = []
    for st in stmts:
        if isinstance(st, ast.Assign) and _is_call_of(st.value, AT):
            _untainted(st.value, tainted, "the inputs of a step")
            out.append(ast.Expr(st.value))
        elif isinstance(st, ast.Expr) and _is_call_of(st.value, AT):
            _untainted(st.value, tainted, "the inputs of a step")
            out.append(st)
        elif isinstance(st, ast.Assert):
            continue
        elif isinstance(st, (ast.Import, ast.ImportFrom, ast.Pass, ast.Break, ast.Continue)):
            out.append(st)
        elif isinstance(st, ast.For) and getattr(st, "grpo_judge_loop", False):
            _untainted(st.iter, tainted, "a loop's iterable")
            names = _names_loaded(ast.Expr(_as_load(st.target)))
            cur, body = set(tainted), []
            for _ in range(len(_statements(st.body)) + 2):  # what one iteration taints reaches the next
                after = set(cur) - names
                body = _first_stage(st.body, after, stateful)
                if after <= cur:
                    break
                cur |= after
            tainted |= cur
            out.append(ast.For(st.target, st.iter, body or [ast.Pass()], [], None))
        elif isinstance(st, ast.For):
            continue  # a loop of asserts over vector probes (hoisted before it): nothing to run
        elif isinstance(st, ast.If):
            _untainted(st.test, tainted, "an if's test")
            t_body, t_else = set(tainted), set(tainted)
            body = _first_stage(st.body, t_body, stateful)
            orelse = _first_stage(st.orelse, t_else, stateful)
            tainted |= t_body | t_else
            out.append(ast.If(st.test, body or [ast.Pass()], orelse))
        else:  # a judge-side statement
            loaded = _names_loaded(st)
            bound = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)
                     and isinstance(n.ctx, (ast.Store, ast.Del))}
            if loaded & tainted or any(_is_call_of(n, VAL) for n in ast.walk(st)):
                receivers = {n.func.value.id for n in ast.walk(st) if isinstance(n, ast.Call)
                             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
                tainted |= bound | receivers | (loaded & stateful)
                if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                        if isinstance(t, (ast.Subscript, ast.Attribute)):
                            tainted |= _names_loaded(t)
            else:
                tainted -= bound
                out.append(st)
    return out


def _as_load(t: ast.AST) -> ast.AST:
    if isinstance(t, ast.Name):
        return ast.Name(t.id, ast.Load())
    if isinstance(t, ast.Starred):
        return ast.Starred(_as_load(t.value), ast.Load())
    if isinstance(t, (ast.Tuple, ast.List)):
        return ast.Tuple([_as_load(e) for e in t.elts], ast.Load())
    return t


def _stmt_source(st: ast.stmt) -> str:
    return ast.unparse(ast.fix_missing_locations(ast.Module(body=[st], type_ignores=[])))


def _as_store(t: ast.AST) -> ast.AST:
    if isinstance(t, ast.Name):
        return ast.Name(t.id, ast.Store())
    if isinstance(t, ast.Starred):
        return ast.Starred(_as_store(t.value), ast.Store())
    return type(t)([_as_store(e) for e in t.elts], ast.Store())


def _mix(kinds: list[str]) -> str:
    return "H" if all(k == "H" for k in kinds) else "M"
