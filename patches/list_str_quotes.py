"""Split a command-line list of strings at the commas outside double quotes.

What: ``ConfigManager.register_tyro_rules`` wrapped: after torchtitan's rule for ``list[str]`` (one argument,
``"a,b".split(",")``) it registers one (later rules win in tyro) that splits at the commas outside double-quoted
parts, so ``--rollout.environment_args 'name="a,b",n=1'`` is ``['name="a,b"', 'n=1']``. Otherwise as torchtitan's:
one argument, ``""`` is ``[""]``, the list written back joined with commas.

Versions: torchtitan 0.3.0 (``torchtitan/config/manager.py``'s ``list_str_rule``, unchanged since 0.2.2); tyro 0.9/1.0's
``ConstructorRegistry.primitive_rule``.

Why: ``rollout.environment_args`` values are JSON, and a JSON string may hold a comma: the environment got half a
value (``'name="a'``) and a broken entry (the fifth sweep).

When: always.
"""

import functools

import tyro

_PATCHED = "_flux_list_str_quotes"


def split_outside_quotes(text: str) -> list[str]:
    """``text`` split at each comma outside a double-quoted part (``\\"`` inside one escapes the quote)."""
    parts, current, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def _quote_aware_rule(type_info: tyro.constructors.PrimitiveTypeInfo):
    if type_info.type != list[str]:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="A,B,C,...",
        instance_from_str=lambda args: split_outside_quotes(args[0]),
        is_instance=lambda instance: all(isinstance(i, str) for i in instance),
        str_from_instance=lambda instance: [",".join(instance)],
    )


def apply() -> bool:
    from torchtitan.config.manager import ConfigManager

    original = ConfigManager.register_tyro_rules
    if getattr(original, _PATCHED, False):
        return True

    @functools.wraps(original)
    def register_tyro_rules(registry: tyro.constructors.ConstructorRegistry) -> None:
        original(registry)
        registry.primitive_rule(_quote_aware_rule)

    setattr(register_tyro_rules, _PATCHED, True)
    ConfigManager.register_tyro_rules = staticmethod(register_tyro_rules)
    return True
