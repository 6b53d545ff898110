"""How a test is rewritten so that every value it operates on goes through the judge's guards; runs
only inside a sandbox child.

Its text is put in front of ``_judge.py``'s (and ``_guards.py``'s and ``_child.py``'s) and executed in the
same private globals (see ``sandbox.py``): :func:`_prepare_test` compiles one test statement as the body of a
function of the five guards ``_guards._make_guards`` builds. Importing it in the trainer defines
functions and runs nothing.
"""

_V, _CALL, _NAME, _ATTR, _OP = "_sbx_value_", "_sbx_call_", "_sbx_name_", "_sbx_attr_", "_sbx_op_"
# AST operator class name -> key of _operators()
_OP_NAMES = {"Eq": "eq", "NotEq": "ne", "Lt": "lt", "LtE": "le", "Gt": "gt", "GtE": "ge", "Is": "is_",
             "IsNot": "is_not", "In": "in_", "NotIn": "not_in", "Add": "add", "Sub": "sub", "Mult": "mul",
             "Div": "truediv", "FloorDiv": "floordiv", "Mod": "mod", "Pow": "pow", "LShift": "lshift",
             "RShift": "rshift", "BitAnd": "and_", "BitOr": "or_", "BitXor": "xor", "MatMult": "matmul",
             "Subscript": "getitem"}
# Builtins whose lambda argument (map's and filter's function, the others' ``key=``) has its body guarded: they
# only call it (the guards make map and filter generators), so its closure, which leads to the guards, never
# reaches the program; ``_make_guards``' ``call`` refuses to hand such a lambda to anything else.
_LAMBDA_CALLS = {"map": 0, "filter": 0, "sorted": "key", "min": "key", "max": "key"}


# The test rewriter is made of plain functions, not a class: every class is reachable from the
# program through ``object.__subclasses__()``, and the globals of its methods would be this
# harness's globals (``_make_guards``, the builtins it looks up), which the program could replace.

def _guard_each(items: list, state) -> list:
    """Each node of ``items`` guarded (:func:`_guard_visit`), a statement that comes back as the statements it is
    made of (a ``match``) spliced in."""
    import ast

    out = []
    for x in items:
        y = _guard_visit(x, state) if isinstance(x, ast.AST) else x
        out.extend(y if type(y) is list else [y])
    return out


def _guard_visit(node, state):
    """Rewrite the AST ``node`` of a test so that every value it operates on goes through the
    guards (see :func:`_make_guards`). Lambda bodies are left alone (a lambda may be handed to the
    program, and its closure must not lead to the guards) but where :data:`_LAMBDA_CALLS` says.
    ``state``: (names the test binds, the set of free names read; every one of those is read through
    ``name``)."""
    import ast

    if isinstance(node, ast.Lambda) and not getattr(node, "sbx_guarded", False):
        return node
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _LAMBDA_CALLS:
        where = _LAMBDA_CALLS[node.func.id]
        for arg in node.args[:1] if where == 0 else [k.value for k in node.keywords if k.arg == where]:
            if isinstance(arg, ast.Lambda):
                arg.sbx_guarded = True
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        node.value.sbx_module = True  # a name used as ``name.attr`` means the module of that name
    for field, old in ast.iter_fields(node):
        if isinstance(old, list):
            old[:] = _guard_each(old, state)
        elif isinstance(old, ast.AST):
            setattr(node, field, _guard_visit(old, state))
    return _guard_rewrite(node, state)


def _op_name(op: str, left, right) -> str:
    """The guards' name of a comparison: ``is`` with a string constant of the test compares as ``==`` does, for a
    ``str`` only (``is_str``): the test's strings are made as it runs (:func:`_fresh_strings`), and the identity with
    a constant the program returned, CPython's interning, that ``f(x) is 'word'`` relied on, is gone."""
    import ast

    if op in ("Is", "IsNot") and any(type(e) is ast.Constant and type(e.value) is str for e in (left, right)):
        return "is_str" if op == "Is" else "is_not_str"
    return _OP_NAMES[op]


def _guard_operate(op: str, left, right):
    import ast

    return ast.Call(ast.Name(_OP, ast.Load()), [ast.Constant(_op_name(op, left, right)), left, right], [])


def _guard_wrap(expr):
    import ast

    return ast.Call(ast.Name(_V, ast.Load()), [expr], [])


def _guard_rewrite(node, state):
    import ast

    bound, used = state[:2]
    w = _guard_wrap
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return _guard_operate(type(node.ops[0]).__name__, node.left, node.comparators[0])
    if isinstance(node, ast.BinOp):
        return _guard_operate(type(node.op).__name__, node.left, node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and not isinstance(node.slice, ast.Slice) \
            and not (isinstance(node.slice, ast.Tuple) and any(isinstance(e, ast.Slice) for e in node.slice.elts)):
        return _guard_operate("Subscript", node.value, node.slice)  # (a slice is no expression: left as it is)
    if isinstance(node, ast.Compare):  # a chain (a < b < c): every operand first, then each comparison guarded
        operands = [node.left, *node.comparators]
        ops = ast.Tuple([ast.Constant(_op_name(type(o).__name__, *operands[i:i + 2])) for i, o in enumerate(node.ops)],
                        ast.Load())
        return ast.Call(ast.Name(_OP, ast.Load()), [ast.Constant("chain"), ops,
                                                    ast.List(operands, ast.Load())], [])
    if isinstance(node, ast.UnaryOp):
        node.operand = w(node.operand)
    elif isinstance(node, ast.BoolOp):
        node.values = [w(v) for v in node.values]
    elif isinstance(node, (ast.IfExp, ast.If, ast.While, ast.Assert)):
        node.test = w(node.test)
    elif isinstance(node, ast.Match):  # its patterns compare the subject natively
        return _guard_match(node, state)
    elif isinstance(node, ast.comprehension):
        node.ifs = [w(c) for c in node.ifs]
    elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        node.elt = w(node.elt)
    elif isinstance(node, ast.DictComp):
        node.key, node.value = w(node.key), w(node.value)
    elif isinstance(node, ast.Call):
        return ast.Call(ast.Name(_CALL, ast.Load()), [node.func, *node.args], node.keywords)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
        used.add(node.id)
        flag = ast.Constant(bool(getattr(node, "sbx_module", False)))
        return ast.Call(ast.Name(_NAME, ast.Load()), [ast.Constant(node.id), flag], [])
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return ast.Call(ast.Name(_ATTR, ast.Load()), [node.value, ast.Constant(node.attr)], [])
    elif isinstance(node, (ast.Import, ast.ImportFrom)) and _import_reads(node):
        pairs = _import_reads(node)
        return ast.Assign([ast.Tuple([ast.Name(t, ast.Store()) for t, _ in pairs], ast.Store())],
                          ast.Tuple([v for _, v in pairs], ast.Load()))
    return node


def _guard_match(node, state) -> list:
    """A ``match`` statement as the statements that make it: its subject (guarded) and then every class, dotted name
    or other expression its patterns name (``case int(n)``, ``case Color.RED``, ``case -1``, each guarded) kept in the
    holder the test makes as it starts (see :func:`_fresh_patterns`), and the statement matching the holder's subject
    against patterns that read the holder's attributes. A pattern admits no call, so a guarded read left there (
    ``case _sbx_name_('int', False)()``) did not compile and an honest test of a class pattern failed (red-team round
    28). The subject is read first, as before; the pattern's names then, all of them before the first case is tried
    (Python reads them as each case is tried: only a name that is missing in a case never reached tells apart)."""
    import ast

    made, hoisted = state[2], []

    def slot(prefix: str, expr, store: bool = False):
        made.append(None)
        ref = ast.Attribute(ast.Name("_sbx_strs", ast.Load()), f"{prefix}{len(made)}", ast.Load())
        hoisted.append(ast.Assign([ast.Attribute(ast.Name("_sbx_strs", ast.Load()), ref.attr, ast.Store())], expr))
        return ref

    def hoistable(e) -> bool:
        return type(e) is not ast.Constant

    node.subject = slot("s", _guard_wrap(node.subject))
    for case in node.cases:
        for p in ast.walk(case.pattern):
            if type(p) is ast.MatchClass:
                p.cls = slot("c", p.cls)
            elif type(p) is ast.MatchValue and hoistable(p.value):
                p.value = slot("c", p.value)
            elif type(p) is ast.MatchMapping:
                p.keys = [slot("c", k) if hoistable(k) else k for k in p.keys]
    return [*hoisted, node]


def _super_explicit(tree) -> None:
    """``super()`` with no arguments in a method the test defines as ``super(__class__, <its first parameter>)``, what
    it means: read through the ``name`` guard, ``super`` is not a name the compiler sees, so it made no ``__class__``
    cell and the call failed (``RuntimeError: super(): __class__ cell not found``, red-team round 28)."""
    import ast

    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)

    def own_calls(fn):  # the ``super()`` calls of this function's own scope
        todo = [c for c in ast.iter_child_nodes(fn) if c is not fn.args and c not in getattr(fn, "decorator_list", ())]
        while todo:
            n = todo.pop()
            if type(n) is ast.Call and type(n.func) is ast.Name and n.func.id == "super" and not n.args \
                    and not n.keywords:
                yield n
            if not isinstance(n, scopes):
                todo.extend(ast.iter_child_nodes(n))

    for cls in [n for n in ast.walk(tree) if type(n) is ast.ClassDef]:
        for fn in ast.walk(cls):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and fn.args.posonlyargs + fn.args.args:
                first = (fn.args.posonlyargs + fn.args.args)[0].arg
                for call in own_calls(fn):
                    call.args = [ast.Name("__class__", ast.Load()), ast.Name(first, ast.Load())]


def _import_reads(node):
    """A test's own ``import m`` / ``from m import a`` of modules loaded before the program ran, as
    ``[(name bound, guarded read)]``: the module as it was (``name``) and its attribute as it was (``attr``),
    not what the program left in ``sys.modules`` or in the module; None for a module loaded since."""
    import ast
    import sys

    def module(n):
        return ast.Call(ast.Name(_NAME, ast.Load()), [ast.Constant(n), ast.Constant(True)], [])

    if isinstance(node, ast.ImportFrom):
        if node.level or node.module not in sys.modules or any(a.name == "*" for a in node.names):
            return None
        return [(a.asname or a.name, ast.Call(ast.Name(_ATTR, ast.Load()), [module(node.module), ast.Constant(a.name)],
                                              [])) for a in node.names]
    if not all(a.name in sys.modules and a.name.split(".")[0] in sys.modules for a in node.names):
        return None
    return [(a.asname, module(a.name)) if a.asname else (a.name.split(".")[0], module(a.name.split(".")[0]))
            for a in node.names]


def _bound_names(tree) -> frozenset:
    """Every name a statement (or module) binds anywhere in it: assignment targets, imports, definitions,
    parameters, ``except ... as`` and ``match`` captures."""
    import ast

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler, ast.MatchAs,
                               ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return frozenset(names)


def _prepare_setup(setup: str):
    """The setup as ``[(code, names it binds, imports)]``, one entry per top-level statement (see
    ``_setupdata._run_setup``), or the SyntaxError/ValueError it raises; parsed before the program runs.
    ``imports``: for an ``import`` statement, ``[(name bound, module, attribute or None)]``."""
    import ast

    def imports(stmt):
        if isinstance(stmt, ast.ImportFrom):
            return [] if stmt.level else [(a.asname or a.name, stmt.module, a.name) for a in stmt.names if a.name != "*"]
        if isinstance(stmt, ast.Import):
            return [(a.asname, a.name, None) if a.asname else (a.name.split(".")[0], a.name.split(".")[0], None)
                    for a in stmt.names]
        return []

    try:
        tree = ast.parse(setup, "<setup>", "exec")
        return [(compile(ast.Module([stmt], []), "<setup>", "exec"), _bound_names(stmt), imports(stmt))
                for stmt in tree.body]
    except (SyntaxError, ValueError) as e:
        return e


def _imported_modules(sources) -> list:
    """The modules the task's tests and setup import (``import a.b``: ``a.b``; ``from a import b``: ``a``, and
    ``a.b`` in case it is a submodule), in order: loaded before the program runs (:func:`_load_imported`), a
    test's or the setup's import reads them as they were, not what the program's finders or ``sys.modules`` give."""
    import ast

    names = []
    for src in sources:
        if type(src) is not str or "import" not in src:
            continue
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.append(node.module)
                names.extend(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    return names


def _prepare_test(src: str):
    """(code, names): a test statement (normally ``assert ...``) compiled as the body of a
    function of the four guards (see :func:`_make_guards`), and the free names it reads (each
    read through the ``name`` guard); raises SyntaxError/ValueError for a test that does not compile."""
    import ast
    import builtins
    import sys

    tree = ast.parse(src, "<test>", "exec")
    _super_explicit(tree)
    _fresh_locals(tree)
    # what the test binds itself is its own (but a module or builtin name it imports or defines, read as the real one)
    bound = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    bound |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    bound |= _bound_names(tree) - {n for n in sys.modules if "." not in n} - set(vars(builtins))
    bound |= {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
              for t, _ in _import_reads(node) or ()}  # (assigned from guarded reads: see _guard_rewrite)
    if any(type(node) is ast.ClassDef for node in ast.walk(tree)):
        bound.add("__class__")  # (a method's own class, the compiler's cell: see _super_explicit)
    state = (frozenset(bound), set(), [])
    body = _guard_each(tree.body, state) or [ast.Pass()]
    body = _failed_asserts(body)
    args = ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in (_V, _CALL, _NAME, _ATTR, _OP)], kwonlyargs=[],
                         kw_defaults=[], defaults=[])
    fn = ast.FunctionDef(name="_sbx_test_", args=args, body=body, decorator_list=[], returns=None)
    module = ast.Module([fn], [])
    _fresh_strings(module)
    code = compile(ast.fix_missing_locations(module), "<test>", "exec")
    # (the names as copies: the parser's own are interned, and kept they told a program a name the test reads)
    return next(c for c in code.co_consts if type(c) is type(code)), tuple(sorted(n.encode().decode()
                                                                                for n in state[1]))


def _failed_asserts(body: list) -> list:
    """A test's body with every ``assert`` of its own (its functions' too) noting that it failed before it raises, and
    the test failing at its end if one did: the program's code that caught the ``AssertionError`` (the ``__exit__``
    of a context manager it handed to the test's ``with``, ``contextlib.suppress(AssertionError)``, its function
    calling a checking function of the test's) passed the test (red-team round 29). One the test catches itself
    fails it too."""
    import ast

    flag = "_sbx_failed"

    def visit(node):  # (statements hold statements, an expression none: a lambda's body is one)
        for field, old in ast.iter_fields(node):
            if type(old) is list and old and isinstance(old[0], (ast.stmt, ast.excepthandler, ast.match_case)):
                for x in old:
                    visit(x)
                old[:] = [mark(x) if type(x) is ast.Assert else x for x in old]

    def mark(a):  # ``if not t: failed.append(1); assert False, msg`` (``t`` as guarded, evaluated once)
        note = ast.Call(ast.Attribute(ast.Name(flag, ast.Load()), "append", ast.Load()), [ast.Constant(1)], [])
        return ast.If(ast.UnaryOp(ast.Not(), a.test), [ast.Expr(note), ast.Assert(ast.Constant(False), a.msg)], [])

    holder = ast.Module(body, [])
    visit(holder)
    end = ast.Assert(ast.UnaryOp(ast.Not(), ast.Name(flag, ast.Load())),
                     ast.Constant("an assertion of the test failed and did not end it"))
    return [ast.Assign([ast.Name(flag, ast.Store())], ast.List([], ast.Load())), ast.Try(holder.body, [], [], [end])]


def _fresh_locals(tree) -> None:
    """Renames the variables a test binds at its top level or in a comprehension (``mango = f(...)``, a ``for``
    target, ``[fig for fig in ...]``) ``_sbx_l0``, ``_sbx_l1``...: the compiled test keeps its variables' names
    interned while the program runs, and a program that found the word of its input already interned returned the
    name a test gave its expected value (red-team round 29). Only a name no function, lambda or class of the test
    binds, nor a ``global`` or ``nonlocal`` names, that nothing binds otherwise (a function, class, import,
    parameter, ``except ... as`` or ``match`` capture keeps its name, and these stay interned: a ``__name__``, a
    keyword argument), and, bound in comprehensions only, read nowhere else (a global of the program's)."""
    import ast

    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    comps = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    nodes = list(ast.walk(tree))
    if not any(type(n) is ast.Name and type(n.ctx) is not ast.Load for n in nodes):
        return  # (most tests, one ``assert``: nothing to rename)
    top, todo, inside, reads = set(), list(tree.body), {}, {}
    while todo:  # the names the test's own scope binds as plain variables
        node = todo.pop()
        if type(node) is ast.Name and type(node.ctx) is not ast.Load:
            top.add(node.id)
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, defs + comps))
    for node in nodes:  # a comprehension's targets, and where they mean its variable (not its first iterable)
        if type(node) is ast.Name:
            reads[node.id] = reads.get(node.id, 0) + 1
        elif isinstance(node, comps):
            targets = {n.id for g in node.generators for n in ast.walk(g.target) if type(n) is ast.Name}
            outer = {id(n) for n in ast.walk(node.generators[0].iter)}
            for n in ast.walk(node):
                if type(n) is ast.Name and n.id in targets and id(n) not in outer:
                    inside.setdefault(n.id, set()).add(id(n))
    mine = top | {n for n, ids in inside.items() if len(ids) == reads[n]}
    for node in nodes:  # what else binds a name, anywhere in the test
        if isinstance(node, defs):
            inner = ast.walk(node)
            next(inner)
            mine -= {n.id for n in inner if type(n) is ast.Name and type(n.ctx) is not ast.Load}
        if type(node) in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
            mine.discard(node.name)
        elif type(node) in (ast.Global, ast.Nonlocal):
            mine -= set(node.names)
        elif type(node) in (ast.Import, ast.ImportFrom):
            mine -= {(a.asname or a.name).partition(".")[0] for a in node.names}
        elif type(node) is ast.arg or type(node) is ast.ExceptHandler or type(node) is ast.keyword:
            mine.discard(node.arg if type(node) is not ast.ExceptHandler else node.name)
        elif type(node) in (ast.MatchAs, ast.MatchStar) or type(node) is ast.MatchMapping:
            mine.discard(node.name if type(node) is not ast.MatchMapping else node.rest)
    names = {n: f"_sbx_l{i}" for i, n in enumerate(sorted(mine - {"__class__"}))}
    for node in nodes:
        if type(node) is ast.Name and node.id in names:
            node.id = names[node.id]


def _fresh_strings(tree) -> None:
    """Makes every string constant of a test that the compiler would intern (ASCII letters, digits and ``_`` only) a
    ``b'...'.decode()`` of its own, run as the test runs. Compiled as a constant, such a string went into the
    interpreter's table of interned strings before the program ran, and the program found a test's expected answer
    there: ``sys.intern(w) is not w`` (or the key ``setattr`` leaves in an instance's ``__dict__``) for each word
    ``w`` of its input said which one the test expects (red-team round 26). A keyword argument's name, and a
    ``match`` pattern's string (:func:`_fresh_patterns`), are made as the test runs too (round 27). The docstring of
    a function or class the test defines stays a constant (a call there is no docstring: ``h.__doc__`` was None, and a
    test reading it failed)."""
    import ast

    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docs = {id(node.body[0]) for top in tree.body for node in ast.walk(top) if node is not top
            and type(node) in defs and node.body and type(node.body[0]) is ast.Expr
            and type(node.body[0].value) is ast.Constant and type(node.body[0].value.value) is str}

    def fresh(value: str):
        return ast.Call(ast.Attribute(ast.Constant(value.encode("ascii")), "decode", ast.Load()), [], [])

    def interned(node) -> bool:
        return type(node) is ast.Constant and type(node.value) is str and node.value.isascii() \
            and node.value.replace("_", "a").isalnum()

    nodes, patterns = list(ast.walk(tree)), []
    for node in nodes:
        if type(node) is ast.MatchValue and interned(node.value):
            patterns.append((node, "value", node.value.value))
        elif type(node) is ast.MatchMapping:
            patterns.extend((node.keys, i, k.value) for i, k in enumerate(node.keys) if interned(k))
        if type(node) is ast.MatchValue or type(node) is ast.MatchMapping or id(node) in docs:
            continue
        for field, old in ast.iter_fields(node):
            if type(node) is ast.JoinedStr and field == "values":  # (an f-string's parts: constants or values)
                node.values = [ast.FormattedValue(fresh(v.value), -1, None) if interned(v) else v for v in old]
            elif type(old) is list:
                setattr(node, field, [fresh(v.value) if interned(v) else v for v in old])
            elif interned(old):
                setattr(node, field, fresh(old.value))
    for node in nodes:  # a keyword argument's name (``dict(mango=1)``): ``**{'mango': 1}``, its key made as it runs
        if type(node) is ast.Call:
            node.keywords = [ast.keyword(None, ast.Dict([fresh(k.arg)], [k.value])) if k.arg is not None
                             and k.arg.isascii() else k for k in node.keywords]
    _fresh_patterns(tree, patterns, fresh)


def _fresh_patterns(tree, patterns, fresh) -> None:
    """A ``match`` pattern's string (``case 'mango':``, a mapping pattern's key) as a value pattern instead, the
    attribute of a function object made as the test runs (``case _sbx_strs.v0:``), which holds the string made then:
    a constant, it would be interned before the program ran (red-team round 27). ``patterns``: (node or key list,
    field or index, string)."""
    import ast

    hoisted = any(type(n) is ast.Name and n.id == "_sbx_strs" for n in ast.walk(tree))  # (_guard_match's)
    if not (patterns or hoisted) or not tree.body or type(tree.body[0]) is not ast.FunctionDef:
        return
    holder, made = "_sbx_strs", []
    for i, (node, where, value) in enumerate(patterns):
        ref = ast.Attribute(ast.Name(holder, ast.Load()), f"v{i}", ast.Load())
        if type(where) is int:
            node[where] = ref
        else:
            setattr(node, where, ref)
        made.append(ast.Assign([ast.Attribute(ast.Name(holder, ast.Load()), f"v{i}", ast.Store())], fresh(value)))
    blank = ast.Lambda(ast.arguments([], [], None, [], [], None, []), ast.Constant(None))
    tree.body[0].body[:0] = [ast.Assign([ast.Name(holder, ast.Store())], blank), *made]


def _load_imported(job: dict) -> bool:
    """Imports the modules the task's tests and setup import (``_rewrite._imported_modules``) before the
    program runs, so that they are in the snapshot and a test's or the setup's import reads them as they were
    (a finder the program put into ``sys.meta_path``, or its ``sys.modules`` entry, would hand them a fake);
    whether any was new (then the snapshot is taken again). A name that is not found (the program's own
    module) is left to the test."""
    import sys

    new = False
    names = [*_READ_ENVIRONMENT_ONCE, *_imported_modules([*job["tests"], job["setup"]])]  # noqa: F821  (_unaudited.py)
    if any("strptime" in src for src in (*job["tests"], job["setup"]) if type(src) is str):
        names.append("_strptime")  # (imported by the interpreter's C code on the test's behalf: see _judge._C_CALLED)
    for name in names:
        if name in sys.modules or name.startswith(_DENY_MODULES) or name.split(".")[0] in ("this", "antigravity"):  # noqa: F821
            continue
        parent = sys.modules.get(name.rpartition(".")[0]) if "." in name else None
        if parent is not None and type(parent) is type(sys) and "__path__" not in vars(parent):
            continue  # (``from math import isclose``: no submodule to look for)
        try:
            __import__(name)
        except BaseException:  # (ImportError: a module the program writes; anything its import raises)
            continue
        new = True
    return new
