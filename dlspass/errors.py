"""The exceptions dlspass raises: one root, two families.

``DLSPassError`` is the root of everything dlspass raises on purpose. ``DLSInputError`` means the
caller's input is wrong (a config value, a file, an unsupported model or optimizer): the CLI
prints one line and exits 2. ``DLSInternalError`` means a contract inside dlspass broke (a pass
left the graph in a state the next one cannot take): the CLI exits 3 and shows the traceback
under ``DLSPASS_DEBUG=1``. Every concrete class belongs to exactly one of the two families
(``tests/test_errors.py`` walks the package to check it).

Each family has one class per builtin base, defined here and nowhere else (``InputValueError``
is both a ``DLSInputError`` and the ``ValueError`` it always was, so existing ``except`` clauses
keep working). A module raises these; the names callers already catch (``ConfigError``,
``FormatError``, ``FaultError``, ...) are these classes under the module's name, or a subclass
where a caller must tell it apart (``ConfigError``, which ``modelzoo`` messages are turned into).

``VerificationError`` (``dlspass.verify``) is a ``DLSInternalError``: inside ``apply_dls`` it means
a pass broke an invariant. ``dlspass verify FILE`` reports it as the command's result (exit 1),
not as a crash.
"""

from __future__ import annotations


class DLSPassError(Exception):
    """Root of every exception dlspass raises on purpose."""


class DLSInputError(DLSPassError):
    """The caller's input is wrong: fix the input (CLI exit code 2)."""


class DLSInternalError(DLSPassError):
    """A dlspass contract broke: a bug in dlspass or in a user pass (CLI exit code 3)."""


class InputValueError(DLSInputError, ValueError):
    """A value the caller passed is out of range or inconsistent with another one."""


class InputTypeError(DLSInputError, TypeError):
    """The caller passed an object of a type dlspass does not take there."""


class InputKeyError(DLSInputError, KeyError):
    """An entry the caller's state (optimizer state, a state_dict) should hold is missing."""


class InputRuntimeError(DLSInputError, RuntimeError):
    """The caller's program or environment cannot be run as asked (tracing failed, a scale floor
    was hit, ``torch.distributed`` is not initialised)."""


class InputNotImplementedError(DLSInputError, NotImplementedError):
    """The caller asked for something dlspass does not support (yet)."""


class InputAssertionError(DLSInputError, AssertionError):
    """The caller broke an ordering rule a torch API states as an assertion (``GradScaler``)."""


class InternalRuntimeError(DLSInternalError, RuntimeError):
    """A step graph lacks what its contract promises (a role, an output); the message names it.

    Raised by the role look-ups in ``dlspass.graph.roles`` (as ``GraphContractError``);
    ``dlspass.passes.PassContractError`` (a pass's precondition or postcondition) is its subclass.
    """


class InternalValueError(DLSInternalError, ValueError):
    """A caller inside dlspass passed values that contradict each other (mismatched lists)."""


GraphContractError = InternalRuntimeError


FAMILIES: tuple[type[DLSPassError], ...] = (DLSInputError, DLSInternalError)
"""The two families every concrete dlspass exception belongs to (exactly one of them)."""
