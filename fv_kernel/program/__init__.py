"""The Program Plane: how a task's loops run for one request."""

from fv_kernel.program.base import InlineProgram, Program, ProgramCompiler, program_for

__all__ = ["InlineProgram", "Program", "ProgramCompiler", "program_for"]
