"""pytest plugin for ddpdoctor (being written): inert unless used."""
