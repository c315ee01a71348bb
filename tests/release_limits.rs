#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Issue 28: release policies from repository administrators are untrusted Rego, bounded. Over
//! HTTP, a tenant administrator's policy that would amplify is refused at upload; one that runs
//! into a limit is that resource's refusal naming the limit, on time, while honest requests on
//! other resources are served.

use std::time::{Duration, Instant};

use cgx_kbs::client::KbsClient;
use cgx_system_tests::*;

/// The review's policy: 22 lines, each squaring the last (5.8 s of a serving thread before).
fn squarings(lines: usize) -> String {
    let mut rego = String::from(
        "package policy\nimport rego.v1\ndefault allow := false\n\
         x0 := count(input.submods) + 98765432109876543210\n",
    );
    for i in 1..=lines {
        rego.push_str(&format!("x{i} := x{p} * x{p}\n", p = i - 1));
    }
    rego.push_str(&format!("allow if x{lines} > 0\n"));
    rego
}

/// Two chains of shared arrays compared at their ends: one VM instruction of seconds.
fn stuck(depth: usize) -> String {
    let mut rego = String::from(
        "package policy\nimport rego.v1\ndefault allow := false\n\
         a0 := [input.tag]\nb0 := [input.tag]\n",
    );
    for i in 1..=depth {
        rego.push_str(&format!(
            "a{i} := [a{p}, a{p}]\nb{i} := [b{p}, b{p}]\n",
            p = i - 1
        ));
    }
    rego.push_str(&format!("allow if a{depth} == b{depth}\n"));
    rego
}

#[test]
fn a_repository_admins_release_policy_is_bounded() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    for tag in ["squares", "stuck", "fine"] {
        put_resource(
            &base,
            &s.admin,
            &format!("tenant-a/key/{tag}"),
            tag.as_bytes(),
            false,
        );
    }
    // Upload: the tenant's administrator may not use a builtin that amplifies.
    let replace = "package policy\nimport rego.v1\ndefault allow := false\n\
                   allow if { a := input.tag; b := replace(a, \"s\", a); count(b) > 0 }\n";
    let (st, body) = set_policy(&base, &s.tenant_admin, "tenant-a/key/squares", replace);
    assert_eq!(st, 400, "{}", String::from_utf8_lossy(&body));
    let detail = json_of(&body)["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(detail.contains("`replace` may not be used"), "{detail}");
    // What is bounded at run time is stored.
    for (tag, rego) in [("squares", squarings(22)), ("stuck", stuck(27))] {
        let (st, body) = set_policy(
            &base,
            &s.tenant_admin,
            &format!("tenant-a/key/{tag}"),
            &rego,
        );
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    }
    let fine = "package policy\nimport rego.v1\ndefault allow := false\n\
                allow if { some _, p in input.submods; p.ear_status == \"affirming\" }\n";
    let (st, _) = set_policy(&base, &s.tenant_admin, "tenant-a/key/fine", fine);
    assert_eq!(st, 200);

    let mut c = KbsClient::with_new_key(&base, None).unwrap();
    c.attest(&n).unwrap();
    assert_eq!(c.resource("tenant-a/key/fine", None).unwrap(), b"fine");
    let started = Instant::now();
    let e = c.resource("tenant-a/key/squares", None).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "{e}");
    assert!(e.to_string().contains("number limit"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    // The stuck policy is refused at its deadline; meanwhile the honest one is served.
    let mut other = KbsClient::with_new_key(&base, None).unwrap();
    other.attest(&n).unwrap();
    let started = Instant::now();
    let refused = std::thread::spawn(move || {
        let e = other.resource("tenant-a/key/stuck", None).unwrap_err();
        (
            e.kind().map(str::to_string),
            e.to_string(),
            started.elapsed(),
        )
    });
    std::thread::sleep(Duration::from_millis(30));
    let t = Instant::now();
    assert_eq!(c.resource("tenant-a/key/fine", None).unwrap(), b"fine");
    let honest = t.elapsed();
    let (kind, text, waited) = refused.join().unwrap();
    assert_eq!(kind.as_deref(), Some("PolicyDeny"), "{text}");
    // The shared-structure comparison is stopped by the value size limit before it can hold
    // a thread.
    assert!(text.contains("value size limit"), "{text}");
    assert!(waited < Duration::from_millis(1500), "{waited:?}");
    assert!(honest < Duration::from_millis(500), "{honest:?}");
    srv.stop();
}
