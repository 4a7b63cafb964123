"""Model-agnostic machinery of the numerics stage: tolerance comparison, kernel hygiene checks, suites, cells.

Suites (what to test, per subject) live in the top-level `suites/` package and in the subject's code; this
package knows only tensors, tolerances and the rules every kernel must follow.
"""
