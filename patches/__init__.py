"""Every monkey-patch torchtitan_flux applies to torchtitan or torch (filled in by the patches work)."""
