"""Bring your own agent: the OpenAI-compatible endpoint of a rollout cell.

* ``app.py`` — :class:`Endpoint`: runs, chat / text completions, recording (FastAPI, vLLM's
  protocol models); ``responses.py`` — results as OpenAI responses and streams.
* ``runs.py`` — the run registry and recorder (whole calls only, budgets, draining).
* ``prompts.py`` — token-exact prompts (previous context ++ delta, else a fresh render).
* ``messages.py`` — message normal form and the ``X-Xlong-Agent`` header.
* ``server.py`` — uvicorn on the engine's loop; ``agents.py`` — external agents as tasks.

Nothing is imported here: vLLM's protocol models are imported where they are used.
May import ``rollout``, ``models`` and ``trajectory`` (and ``ray`` for the ``serve`` cell), never
``ray.rllib``: the RLlib runner (``rllib/env_runner.py``) and the cells host it.
"""
