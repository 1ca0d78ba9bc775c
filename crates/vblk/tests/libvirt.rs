//! docs/libvirt.md's domain XML is a valid libvirt domain (`virt-xml-validate`, from
//! Debian's libvirt-clients) with what a vhost-user disk needs: shared memfd memory and
//! a `vhostuser` disk on a unix socket with the raw driver.

mod support;

use std::fs;
use std::path::Path;
use std::process::Command;

use support::assets::require_program;
use support::util::temp_dir;

/// The ```xml blocks of a markdown file.
fn xml_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```xml") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[test]
fn the_documented_domain_xml_validates() {
    let validate = require_program("virt-xml-validate", "libvirt-clients");
    // virt-xml-validate runs xmllint, which libvirt-clients only recommends.
    require_program("xmllint", "libxml2-utils");
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/libvirt.md");
    let text = fs::read_to_string(&doc).unwrap();
    let blocks = xml_blocks(&text);
    assert_eq!(blocks.len(), 1, "docs/libvirt.md has one domain XML");
    let xml = &blocks[0];
    for needed in [
        "<source type='memfd'/>",
        "<access mode='shared'/>",
        "<disk type='vhostuser' device='disk'>",
        "<driver name='qemu' type='raw' queues='4'/>",
        "<source type='unix' path='/run/vblk/vm1.sock'>",
    ] {
        assert!(xml.contains(needed), "the domain lacks {needed}");
    }
    let dir = temp_dir("libvirt");
    let file = dir.path().join("vm1.xml");
    fs::write(&file, xml).unwrap();
    let out = Command::new(&validate)
        .arg(&file)
        .arg("domain")
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "virt-xml-validate: {said}");
    assert!(said.contains("validates"), "{said}");
    // And a broken one is refused, so the check is real.
    fs::write(
        &file,
        xml.replace("type='vhostuser'", "type='no-such-type'"),
    )
    .unwrap();
    let bad = Command::new(&validate)
        .arg(&file)
        .arg("domain")
        .output()
        .unwrap();
    assert!(
        !bad.status.success(),
        "virt-xml-validate accepted an unknown disk type"
    );
}
