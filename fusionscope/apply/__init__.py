"""`apply`: patch the found fusions into a model, check the numerics, and measure before and after.

`fusionscope.apply(...)` is the API the CLI's `apply` command stands on; this package is that callable
(its module object answers calls), so `fusionscope.apply` means the same thing whether or not a submodule such as
`fusionscope.apply.patching` has been imported — an attribute and a subpackage of one name would otherwise replace
each other on import.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from fusionscope.apply.run import apply

        return apply(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
