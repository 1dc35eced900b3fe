"""FAKE torchvision, named as such: only for importing SGLang's source on a CPU machine.

PyPI's torchvision wheels are CUDA builds that fail to import next to CPU torch ("operator
torchvision::nms does not exist"), and SGLang 0.5.17 imports ``torchvision.io.decode_jpeg`` at the
top of ``sglang/srt/utils/common.py`` (for image inputs, which the contract tests never use). The
contract runner puts this directory on ``sys.path`` only when the real torchvision cannot be
imported; anything that calls into it raises.
"""

FAKE = True
__version__ = "0.0.0+fake"
