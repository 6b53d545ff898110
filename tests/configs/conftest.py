import pytest


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops(request):
    """Compile DeepSpeed's CPU kernels once before a real run needs them (as tests/dist does)."""
    if not any("dist" in item.keywords for item in request.session.items):
        return []
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()


@pytest.fixture(scope="module", autouse=True)
def activations_traced_once_per_model():
    """The files here are planned for one model (the tiny GPT recipe at one sequence length), so the activation
    trace each plan takes (``hardware.trace_activations``: a fake-tensor forward and backward, about 0.2 s) is
    taken once per model in a module and reused. The key is the code and the captured values of the callables
    handed to it (the model spec, its config, the sequence length); anything that cannot be keyed is traced."""
    from dstrain.engine import hardware
    real = hardware.trace_activations
    traced = {}

    def key_of(fn):
        if fn is None:
            return None
        return fn.__code__, repr([cell.cell_contents for cell in fn.__closure__ or ()])

    def traced_once(*args, **kwargs):
        try:
            key = (tuple(key_of(a) for a in args), tuple((k, key_of(v)) for k, v in sorted(kwargs.items())))
        except (AttributeError, ValueError):
            return real(*args, **kwargs)
        if key not in traced:
            traced[key] = real(*args, **kwargs)
        return traced[key]

    hardware.trace_activations = traced_once
    yield
    hardware.trace_activations = real
