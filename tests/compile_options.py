"""XLA options for tests that read a compiled program's structure.

The fast tier compiles with XLA:CPU's legacy fusion emitters (see
``FAST_COMPILE_FLAGS`` in ``conftest.py``): they compile small programs in
about half the time, but they fuse differently. A test that counts fusions,
copies or temporary bytes compiles with these options instead, so it reads
the program users get (XLA's defaults) in every tier.
"""

# jax.jit(..., compiler_options=USER_DEFAULT) or .compile(compiler_options=...)
USER_DEFAULT = {"xla_cpu_use_fusion_emitters": True}
