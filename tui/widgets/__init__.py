"""The dashboard's widgets, one per panel."""
