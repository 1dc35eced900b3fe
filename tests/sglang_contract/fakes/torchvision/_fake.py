"""The one FAKE object every name of this fake torchvision resolves to: attributes chain, calls raise."""


class Fake:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "Fake":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Fake(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"fake torchvision (tests/sglang_contract/fakes): {self._name} is not available")

    def __repr__(self) -> str:
        return f"<fake torchvision {self._name}>"


def module_getattr(module: str):
    def __getattr__(name: str) -> Fake:
        if name.startswith("__"):
            raise AttributeError(name)
        return Fake(f"{module}.{name}")

    return __getattr__
