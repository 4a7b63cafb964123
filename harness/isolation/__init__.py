"""Isolation, static part: does a change stay in its model's area, and does its code keep out of everyone else's?

- `scope`: a subject's code scope (the `[isolation]` table of its scope file) and its validation.
- `gitdiff`: the changed paths of base..head and their text at head.
- `classify`: each changed path's area (model, allowed, shared component needing review, outside) and the
  co-change rules.
- `hygiene` (with `bindings` and `rules.toml`): AST rules on the changed model code.
- `judge`: the judgement of one change and the stage records it becomes.
- `command`: `k3gate isolation`; `redteam`: the broken changes the stage must fail; `scratch`: tiny git repos.
"""
