"""Which Keras: version and flavour detection, and one public class name for both Keras.

Public names only (`__version__`, `__module__`): Keras 3 (`import keras`), Keras 2
(`tf_keras`, or `keras` itself on TF <= 2.15). `OneNameForBothKeras` is the one way
the library's public classes (`GradientAccumulator`, `GradientCache`, the callbacks)
pick their Keras 2 class; it imports nothing of the library.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from types import ModuleType
from typing import Any, Optional

import keras
import tensorflow as tf


def version_tuple(text: str) -> tuple:
    """(major, minor) of a version string such as '3.15.1'.

    Args:
        text: the version string.

    Returns:
        `(major, minor)` as ints.
    """
    return tuple(int(part) for part in text.split(".")[:2])


def keras_is_3() -> bool:
    """Whether `import keras` is Keras 3 (False on TF <= 2.15, whose `keras` is Keras 2)."""
    return version_tuple(keras.__version__) >= (3, 0)


def keras2_module() -> Optional[ModuleType]:
    """The Keras 2 package: `tf_keras` where installed (TF >= 2.16), else `keras`
    when it is Keras 2 (TF <= 2.15); None where there is none."""
    if not keras_is_3():
        return keras
    if importlib.util.find_spec("tf_keras") is None:
        return None
    return importlib.import_module("tf_keras")


def keras_package_of_class(klass: type) -> Optional[ModuleType]:
    """The Keras package (`keras` or `tf_keras` module) that defines `klass` or a base of it.

    Args:
        klass: a class.

    Returns:
        The module, or None for a class of neither Keras.
    """
    for base in getattr(klass, "__mro__", ()):
        root = base.__module__.split(".")[0]
        if root in ("keras", "tf_keras") and root in sys.modules:
            return sys.modules[root]
    return None


def keras_package_of(obj: Any) -> Optional[ModuleType]:
    """The Keras package (`keras` or `tf_keras` module) that defines `obj`'s class.

    Args:
        obj: any object (an optimizer, a model, a layer).

    Returns:
        The module, or None for an object of neither Keras.
    """
    return keras_package_of_class(type(obj))


def is_keras2_object(obj: Any) -> bool:
    """Whether `obj` belongs to Keras 2.

    Args:
        obj: any object (an optimizer, a model).

    Returns:
        True for an object of Keras 2's classes.
    """
    package = keras_package_of(obj)
    return package is not None and not package.__version__.startswith("3.")


def tf_keras_is_keras2() -> bool:
    """Whether `tf.keras` is Keras 2 (TF <= 2.15, or TF >= 2.16 imported with
    TF_USE_LEGACY_KERAS=1 and tf_keras installed): what TensorFlow decided at import."""
    return not keras_is_3() or str(getattr(tf.keras, "__version__", "3")).startswith("2.")


class OneNameForBothKeras(type):
    """Metaclass of the public classes that exist once per Keras (`GradientAccumulator`, ...).

    The Keras 2 class cannot subclass the Keras 3 one: their Keras bases differ. So the
    class of `import keras` is the public name; calling it with a Keras 2 object makes
    the Keras 2 class, and `isinstance` / `issubclass` hold for both.

    A public class (a "front") defines, in its own body:

    * `_make_keras2_class(keras2)`, a staticmethod: its class for the Keras 2 package
      `keras2` (imported from its Keras 2 module, or made there), asked once per package
      (on TF <= 2.15 `keras2` may be `keras` itself, whose class the front may already be);
    * optionally `_keras_of_arguments(*args, **kwargs)`, a staticmethod: the Keras 2
      package its arguments belong to, or None (then calling it makes the front itself).

    A user's subclass of a front is a plain class: no dispatch, plain `isinstance`.

    `inspect.signature(Class)`, and so `help(Class)` and the API reference, show the
    class's own `__init__` parameters (`__signature__` below), not the `(*args,
    **kwargs)` of the dispatching `__call__`.
    """

    @property
    def __signature__(cls) -> Optional[inspect.Signature]:
        """The parameters a call takes: the class's `__init__` less `self`.

        A property of the metaclass, so the classes have it and their instances (a
        `GradientCache` model is callable) keep their own `__call__`'s signature.
        None where `__init__` has none to read; `inspect` then falls back to its own.
        """
        try:
            init = inspect.signature(cls.__init__)
        except (TypeError, ValueError):
            return None
        return init.replace(parameters=list(init.parameters.values())[1:])

    def __call__(cls, *args, **kwargs):
        if "_keras_of_arguments" in vars(cls):
            flavour = cls.for_keras(cls._keras_of_arguments(*args, **kwargs))
            if flavour is not cls:
                return flavour(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def for_keras(cls, package: Optional[ModuleType]) -> type:
        """This public class's class for the Keras `package`.

        Args:
            package: `tf_keras` (or TF 2.15's `keras`) for the Keras 2 class; Keras 3's
                `keras` or None for this class itself.

        Returns:
            The class; `isinstance` against the public name holds for its instances.
        """
        if not _is_front(cls) or not _is_keras2_package(package):
            return cls
        made = cls._keras2_classes
        if package not in made:
            made[package] = cls._make_keras2_class(package)
        return made[package]

    def __instancecheck__(cls, obj):
        return cls.__subclasscheck__(type(obj))

    def __subclasscheck__(cls, subclass):
        if super().__subclasscheck__(subclass):
            return True
        package = keras_package_of_class(subclass)
        if not _is_front(cls) or not _is_keras2_package(package):
            return False
        return type.__subclasscheck__(cls.for_keras(package), subclass)

    def __init__(cls, name, bases, namespace, **kwargs):
        super().__init__(name, bases, namespace, **kwargs)
        if "_make_keras2_class" in namespace:
            cls._keras2_classes = {}


def _is_front(cls) -> bool:
    """Whether `cls` is a public front (defines `_make_keras2_class`), not a user's subclass."""
    return "_make_keras2_class" in vars(cls)


def _is_keras2_package(package) -> bool:
    """Whether `package` is a Keras 2 module."""
    return package is not None and not package.__version__.startswith("3.")
