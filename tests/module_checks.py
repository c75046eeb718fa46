"""Checks shared by the module tests."""
from npattn.autograd import gradcheck


def gradcheck_module(module, *inputs, **options):
    """gradcheck of ``module(*inputs, **options)`` with respect to the inputs that require
    gradients and every parameter (each swapped in as a plain input)."""
    owners = []
    for name, _ in module.named_parameters():
        path, _, attribute = name.rpartition(".")
        owner = dict(module.named_modules())[path]
        owners.append((owner, attribute))
    parameters = module.parameters()

    def call(*args):
        for (owner, attribute), value in zip(owners, args[len(inputs):]):
            setattr(owner, attribute, value)
        return module(*args[:len(inputs)], **options)

    try:
        assert gradcheck(call, [*inputs, *parameters])
    finally:
        for (owner, attribute), value in zip(owners, parameters):
            setattr(owner, attribute, value)
