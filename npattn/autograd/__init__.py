"""Reverse-mode autograd (Tensor, Function, engine, gradcheck): not implemented yet.

Until it lands, gradients come from :func:`npattn.attention_vjp`.
"""
