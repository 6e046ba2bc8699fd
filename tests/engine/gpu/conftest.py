"""Triton's interpreter for the kernels' tests where there is no GPU (CI): Triton fixes its mode when it
is first imported (engine.gpu.triton_build), so TRITON_INTERPRET is set here, before any test module
imports it. On a GPU machine Triton compiles and the same tests run the kernels on CUDA tensors."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
