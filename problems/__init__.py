"""Objectives that the server and the workers both load (see ``problems/base.py``).

``load_problem(spec, options, device)`` builds a built-in (``BUILTIN_PROBLEMS``) or a user's
``"module:callable"``.
"""

from problems.base import GradResult, Layout, Problem, layout_size, split_params
from problems.loader import BUILTIN_PROBLEMS, load_problem

__all__ = ["BUILTIN_PROBLEMS", "GradResult", "Layout", "Problem", "layout_size", "load_problem", "split_params"]
