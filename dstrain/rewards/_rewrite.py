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

def _guard_visit(node, state):
    """Rewrite the AST ``node`` of a test so that every value it operates on goes through the
    guards (see :func:`_make_guards`). Lambda bodies are left alone (a lambda may be handed to the
    program, and its closure must not lead to the guards) but where :data:`_LAMBDA_CALLS` says.
    ``state``: (names to route through ``name``: builtins and loaded modules, names the test binds,
    the set of free names read)."""
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
            old[:] = [_guard_visit(x, state) if isinstance(x, ast.AST) else x for x in old]
        elif isinstance(old, ast.AST):
            setattr(node, field, _guard_visit(old, state))
    return _guard_rewrite(node, state)


def _guard_operate(op: str, left, right):
    import ast

    return ast.Call(ast.Name(_OP, ast.Load()), [ast.Constant(_OP_NAMES[op]), left, right], [])


def _guard_wrap(expr):
    import ast

    return ast.Call(ast.Name(_V, ast.Load()), [expr], [])


def _guard_rewrite(node, state):
    import ast

    names, bound, used = state
    w = _guard_wrap
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return _guard_operate(type(node.ops[0]).__name__, node.left, node.comparators[0])
    if isinstance(node, ast.BinOp):
        return _guard_operate(type(node.op).__name__, node.left, node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and not isinstance(node.slice, ast.Slice) \
            and not (isinstance(node.slice, ast.Tuple) and any(isinstance(e, ast.Slice) for e in node.slice.elts)):
        return _guard_operate("Subscript", node.value, node.slice)  # (a slice is no expression: left as it is)
    if isinstance(node, ast.Compare):  # a chain (a < b < c): every operand first, then each comparison guarded
        ops = ast.Tuple([ast.Constant(_OP_NAMES[type(o).__name__]) for o in node.ops], ast.Load())
        return ast.Call(ast.Name(_OP, ast.Load()), [ast.Constant("chain"), ops,
                                                    ast.List([node.left, *node.comparators], ast.Load())], [])
    if isinstance(node, ast.UnaryOp):
        node.operand = w(node.operand)
    elif isinstance(node, ast.BoolOp):
        node.values = [w(v) for v in node.values]
    elif isinstance(node, (ast.IfExp, ast.If, ast.While, ast.Assert)):
        node.test = w(node.test)
    elif isinstance(node, ast.Match):  # its patterns compare the subject natively
        node.subject = w(node.subject)
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
        if node.id in names:
            flag = ast.Constant(bool(getattr(node, "sbx_module", False)))
            return ast.Call(ast.Name(_NAME, ast.Load()), [ast.Constant(node.id), flag], [])
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return ast.Call(ast.Name(_ATTR, ast.Load()), [node.value, ast.Constant(node.attr)], [])
    return node


def _prepare_test(src: str):
    """(code, names): a test statement (normally ``assert ...``) compiled as the body of a
    function of the four guards (see :func:`_make_guards`), and the free names it reads;
    raises SyntaxError/ValueError for a test that does not compile."""
    import ast
    import builtins
    import sys

    tree = ast.parse(src, "<test>", "exec")
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    names = {n for n in sys.modules if "." not in n} | set(vars(builtins))
    state = (frozenset(names - bound), frozenset(bound), set())
    body = [_guard_visit(stmt, state) for stmt in tree.body] or [ast.Pass()]
    args = ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in (_V, _CALL, _NAME, _ATTR, _OP)], kwonlyargs=[],
                         kw_defaults=[], defaults=[])
    fn = ast.FunctionDef(name="_sbx_test_", args=args, body=body, decorator_list=[], returns=None)
    module = ast.fix_missing_locations(ast.Module([fn], []))
    code = compile(module, "<test>", "exec")
    return next(c for c in code.co_consts if type(c) is type(code)), tuple(sorted(state[2]))
