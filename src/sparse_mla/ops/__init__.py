"""One package per capability, each laid out the same way: ``api.py`` (the public entries and
their custom ops), ``config.py`` (``<Op>Config`` and its chooser), the Triton kernels in files
named by algorithm, ``naive.py`` (a readable PyTorch reference) and a README
(docs/DEVELOPING.md, "Layout")."""
