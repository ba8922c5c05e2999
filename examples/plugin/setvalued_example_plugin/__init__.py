"""An example plugin of setvalued-studies (docs/plugins.md): a label-smoothed top-K hinge loss
(``ls_topk_hinge``), a toy data set (``toy_rings``) and a small model (``residual_mlp``).

Importing this package imports nothing: ``declarations`` (read when a study is validated) is
pure Python, and the torch code (``loss``, ``data``, ``model``) is imported by the trainer only.
"""
