"""FAKE torchvision submodule (see the package docstring): every name is a fake that raises when called."""

from torchvision._fake import module_getattr

__getattr__ = module_getattr(__name__)
