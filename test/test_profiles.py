"""Robot profiles: bundled YAML files, skill lookup, argument parsing and error messages."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.profiles import (
    PROFILES_DIR,
    SkillArg,
    available_profiles,
    load_profile,
    load_profile_file,
)

BUNDLED = ['chatbot', 'chatbot_paragraph', 'indy7', 'tello']


def _valid_literal(arg: SkillArg) -> str:
    if arg.type == 'str':
        return "'red_box'"
    low = arg.min if arg.min is not None else 0.0
    high = arg.max if arg.max is not None else low + 10.0
    value = (low + high) / 2
    return str(int(value)) if arg.type == 'int' else f'{value + 0.5:g}'


def _wrong_literal(arg: SkillArg) -> str:
    return '12' if arg.type == 'str' else "'abc'"


def _minimal_profile(**overrides: object) -> dict:
    data: dict = {
        'name': 'mini',
        'kind': 'drone',
        'segment_generation_s': 0.1,
        'max_segment_tokens': 10,
        'max_tokens': 64,
        'exec_time_provenance': 'test figures, not measured',
        'skills': [
            {
                'name': 'move_forward',
                'short': 'mf',
                'args': [{'name': 'distance', 'type': 'int', 'min': 20, 'max': 500}],
                'exec_time': {
                    'kind': 'parametric',
                    'argument': 'distance',
                    'coefficients': [1.0, 0.01],
                },
            },
        ],
        'prompt': {'system': 'plan'},
    }
    data.update(overrides)
    return data


def _write(tmp_path: Path, data: object, name: str = 'mini.yaml') -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding='utf-8')
    return path


# --- bundled profiles ---------------------------------------------------------------------------


def test_bundled_profiles_are_listed():
    assert set(BUNDLED) <= set(available_profiles())


@pytest.mark.parametrize('name', BUNDLED)
def test_every_bundled_profile_loads(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.exec_time_provenance.strip()
    assert profile.prompt.system.strip()
    for skill in profile.skills:
        assert skill.exec_time.source not in ('', 'unspecified'), skill.name
    # by path as well as by name
    assert load_profile_file(PROFILES_DIR / f'{name}.yaml').name == name


def test_tello_header_fields():
    tello = load_profile('tello')
    assert tello.kind == 'drone'
    assert tello.segmentation == 'skills'
    assert tello.segment_generation_s == pytest.approx(0.09)
    assert tello.max_segment_tokens == 10
    assert tello.max_tokens == 64
    assert 'not measured' in tello.exec_time_provenance


def test_indy7_and_chatbot_header_fields():
    indy7 = load_profile('indy7')
    assert (indy7.kind, indy7.segment_generation_s, indy7.max_segment_tokens) == ('arm', 0.16, 20)
    assert indy7.max_tokens == 256
    chatbot = load_profile('chatbot')
    assert chatbot.kind == 'chatbot'
    assert chatbot.segmentation == 'sentence'
    assert chatbot.words_per_minute == 300
    assert chatbot.skills == []
    assert chatbot.max_tokens == 512


def test_derived_figures_say_so():
    tello = load_profile('tello')
    for key in ('to', 'ld'):
        assert 'derived from vendor spec' in tello.skill(key).exec_time.source
    indy7 = load_profile('indy7')
    for key in ('mj', 'mt', 'grip', 'release', 'check'):
        assert 'derived' in indy7.skill(key).exec_time.source


# --- skill lookup -------------------------------------------------------------------------------


def test_skill_lookup_by_name_short_and_alias():
    tello = load_profile('tello')
    assert tello.skill('scan') is tello.skill('s') is tello.skill('s(')
    assert tello.skill('sa(').name == 'scan_abstract'
    assert tello.skill('g(').name == 'goto'
    assert tello.skill('mf').name == 'move_forward'
    assert tello.skill('tu').name == 'turn_ccw'
    indy7 = load_profile('indy7')
    assert indy7.skill('take').name == 'pick'
    assert indy7.skill('drop').name == 'place'
    assert indy7.skill('goto').name == 'move_to'
    assert indy7.skill('scan').name == 'detect'


def test_unknown_skill_raises():
    with pytest.raises(ProfileError, match='unknown skill'):
        load_profile('tello').skill('fly_to_the_moon')


# --- statement patterns -------------------------------------------------------------------------


def _skills():
    for name in ('tello', 'indy7'):
        for skill in load_profile(name).skills:
            yield pytest.param(name, skill.name, id=f'{name}-{skill.short}')


@pytest.mark.parametrize(('profile_name', 'skill_name'), list(_skills()))
def test_statement_pattern_matches_valid_and_rejects_wrong_type(profile_name, skill_name):
    skill = load_profile(profile_name).skill(skill_name)
    valid = f'{skill.short}({",".join(_valid_literal(a) for a in skill.args)})'
    assert skill.compiled.fullmatch(valid), valid
    # every valid literal also parses within the limits
    for arg in skill.args:
        arg.parse(_valid_literal(arg))
    if skill.args:
        wrong = f'{skill.short}({",".join(_wrong_literal(a) for a in skill.args)})'
    else:
        wrong = f'{skill.short}(5)'
    assert not skill.compiled.fullmatch(wrong), wrong
    assert not skill.compiled.fullmatch(valid + 'x')


def test_statement_pattern_examples():
    tello = load_profile('tello')
    assert tello.skill('mf').compiled.fullmatch('mf(100)')
    assert tello.skill('mf').compiled.fullmatch('mf( 100 )')
    assert not tello.skill('mf').compiled.fullmatch('mf(1.5)')
    assert tello.skill('s').compiled.fullmatch("s('cat')")
    assert tello.skill('d').compiled.fullmatch('d(1.5)')
    assert tello.skill('to').compiled.fullmatch('to()')
    indy7 = load_profile('indy7')
    assert indy7.skill('mj').compiled.fullmatch('mj(0,0,-90,0,-90,0)')
    assert not indy7.skill('mj').compiled.fullmatch('mj(0,0,-90)')
    assert indy7.skill('place').compiled.fullmatch("place('red_box','blue_box')")


def test_custom_pattern_is_used_and_must_compile(tmp_path):
    data = _minimal_profile()
    data['skills'][0]['pattern'] = r'mf\(\d+\)'
    profile = load_profile_file(_write(tmp_path, data))
    assert profile.skill('mf').statement_pattern == r'mf\(\d+\)'
    data['skills'][0]['pattern'] = r'mf\((\d+'
    with pytest.raises(ProfileError, match=r'skills\[0\].*pattern does not compile'):
        load_profile_file(_write(tmp_path, data))


# --- argument parsing ---------------------------------------------------------------------------


def test_skill_arg_parse_enforces_limits():
    distance = load_profile('tello').skill('mf').args[0]
    assert distance.parse('50') == 50
    assert isinstance(distance.parse('50'), int)
    with pytest.raises(ValueError, match='below the minimum 20'):
        distance.parse('10')
    with pytest.raises(ValueError, match='above the maximum 500'):
        distance.parse('600')
    with pytest.raises(ValueError, match='not int'):
        distance.parse('1.5')


def test_skill_arg_parse_types():
    seconds = load_profile('tello').skill('d').args[0]
    assert seconds.parse(' 2.5 ') == 2.5
    with pytest.raises(ValueError, match='not float'):
        seconds.parse("'x'")
    obj = load_profile('tello').skill('s').args[0]
    assert obj.parse("'cat'") == 'cat'
    assert obj.parse('"cat"') == 'cat'
    assert obj.parse('cat') == 'cat'
    with pytest.raises(ValueError, match='not a string'):
        obj.parse('12')


def test_skill_arg_validation():
    with pytest.raises(ValueError, match='string arguments take no min/max'):
        SkillArg(name='x', type='str', min=0)
    with pytest.raises(ValueError, match='min 5.0 > max 1.0'):
        SkillArg(name='x', type='int', min=5, max=1)


# --- invalid profile files ----------------------------------------------------------------------


def test_minimal_profile_loads(tmp_path):
    profile = load_profile_file(_write(tmp_path, _minimal_profile()))
    assert profile.skill('mf').exec_time.min_s({'distance': 100}) == pytest.approx(2.0)


def test_parametric_without_coefficients_names_file_and_field(tmp_path):
    data = _minimal_profile()
    data['skills'][0]['exec_time'] = {'kind': 'parametric', 'argument': 'distance'}
    path = _write(tmp_path, data, 'broken_coeffs.yaml')
    with pytest.raises(ProfileError) as info:
        load_profile_file(path)
    message = str(info.value)
    assert str(path) in message
    assert 'broken_coeffs.yaml' in message
    assert 'skills[0]' in message
    assert 'exec_time' in message
    assert 'coefficients' in message


def test_unknown_exec_time_kind(tmp_path):
    data = _minimal_profile()
    data['skills'][0]['exec_time'] = {'kind': 'magic', 'seconds': 1}
    with pytest.raises(ProfileError, match=r'mini\.yaml.*skills\[0\].*exec_time'):
        load_profile_file(_write(tmp_path, data))


def test_duplicated_short_form(tmp_path):
    data = _minimal_profile()
    data['skills'].append(
        {
            'name': 'move_far',
            'short': 'mf',
            'exec_time': {'kind': 'constant', 'seconds': 1.0},
        }
    )
    with pytest.raises(ProfileError, match=r"mini\.yaml.*'mf' used by move_forward and move_far"):
        load_profile_file(_write(tmp_path, data))


def test_duplicated_alias(tmp_path):
    data = _minimal_profile()
    data['skills'][0]['aliases'] = ['go']
    data['skills'].append(
        {
            'name': 'goto',
            'short': 'g',
            'aliases': ['go'],
            'exec_time': {'kind': 'constant', 'seconds': 1.0},
        }
    )
    with pytest.raises(ProfileError, match="'go' used by"):
        load_profile_file(_write(tmp_path, data))


def test_unknown_field_is_named(tmp_path):
    data = _minimal_profile(colour='red')
    with pytest.raises(ProfileError, match=r'mini\.yaml.*colour'):
        load_profile_file(_write(tmp_path, data))


def test_bad_arg_limits_are_named(tmp_path):
    data = _minimal_profile()
    data['skills'][0]['args'][0]['min'] = 600
    with pytest.raises(ProfileError, match=r'skills\[0\]\(move_forward\)\.args\[0\]'):
        load_profile_file(_write(tmp_path, data))


def test_skills_profile_without_skills(tmp_path):
    with pytest.raises(ProfileError, match='needs at least one skill'):
        load_profile_file(_write(tmp_path, _minimal_profile(skills=[])))


def test_text_profile_needs_reading_speed(tmp_path):
    data = _minimal_profile(kind='chatbot', segmentation='sentence', skills=[])
    with pytest.raises(ProfileError, match='words_per_minute'):
        load_profile_file(_write(tmp_path, data))


def test_missing_provenance(tmp_path):
    data = _minimal_profile()
    del data['exec_time_provenance']
    with pytest.raises(ProfileError, match=r'mini\.yaml.*exec_time_provenance'):
        load_profile_file(_write(tmp_path, data))


def test_non_mapping_yaml(tmp_path):
    path = tmp_path / 'list.yaml'
    path.write_text('- a\n- b\n', encoding='utf-8')
    with pytest.raises(ProfileError, match=r'list\.yaml.*must be a mapping, got list'):
        load_profile_file(path)
    empty = tmp_path / 'empty.yaml'
    empty.write_text('', encoding='utf-8')
    with pytest.raises(ProfileError, match=r'empty\.yaml.*got NoneType'):
        load_profile_file(empty)


def test_yaml_syntax_error(tmp_path):
    path = tmp_path / 'syntax.yaml'
    path.write_text('name: [unclosed\nkind: drone\n', encoding='utf-8')
    with pytest.raises(ProfileError, match=r'syntax\.yaml.*not valid YAML'):
        load_profile_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r'nope\.yaml.*cannot read profile'):
        load_profile_file(tmp_path / 'nope.yaml')


def test_unknown_profile_name_lists_available(tmp_path):
    with pytest.raises(
        ProfileError, match=r"unknown robot profile 'submarine'.*available:.*tello"
    ):
        load_profile('submarine')
    _write(tmp_path, _minimal_profile())
    with pytest.raises(ProfileError, match=r'available: mini$'):
        load_profile('other', profiles_dir=tmp_path)
    assert load_profile('mini', profiles_dir=tmp_path).name == 'mini'
    assert available_profiles(tmp_path) == ['mini']


def test_reload_after_edit(tmp_path):
    path = _write(tmp_path, _minimal_profile())
    assert load_profile('mini', tmp_path).max_tokens == 64
    path.write_text(yaml.safe_dump(_minimal_profile(max_tokens=99)), encoding='utf-8')
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_profile('mini', tmp_path).max_tokens == 99


# --- prompt and reading time --------------------------------------------------------------------


def test_build_prompt_contains_every_part():
    tello = load_profile('tello')
    task = 'Find the red ball and land next to it.'
    prompt = tello.build_prompt(task)
    for skill in tello.skills:
        assert skill.usage() in prompt
    assert 'mf(distance:int cm)' in prompt
    assert tello.prompt.guidance.strip() in prompt
    for example in tello.prompt.examples_for(task):
        assert example['task'] in prompt and example['plan'] in prompt
    assert prompt.startswith(tello.prompt.system.strip())
    assert prompt.endswith(f'Task: {task}\nPlan:')


def test_chatbot_prompt_has_no_skill_list():
    prompt = load_profile('chatbot').build_prompt('Tell me a joke.')
    assert 'Skills:' not in prompt
    assert prompt.endswith('Task: Tell me a joke.\nPlan:')


def _statements(plan: str) -> list[str]:
    """Split a MiniSpec plan into its skill calls (strips ?cond{ and N{ wrappers)."""
    calls = re.findall(r"[A-Za-z_]\w*\((?:'[^']*'|[^()'])*\)", plan)
    assert calls, plan
    return calls


@pytest.mark.parametrize('name', ['tello', 'indy7'])
def test_prompt_examples_use_valid_calls(name):
    profile = load_profile(name)
    for example in profile.prompt.all_examples:
        for call in _statements(example['plan']):
            skill = profile.skill(call.split('(')[0])
            assert skill.compiled.fullmatch(call), call
            inner = call[call.index('(') + 1 : -1]
            literals = [p for p in inner.split(',') if p.strip()] if inner.strip() else []
            assert len(literals) == len(skill.args), call
            for arg, literal in zip(skill.args, literals, strict=True):
                arg.parse(literal)


def test_reading_time():
    chatbot = load_profile('chatbot')
    text = 'one two three four five six seven eight nine ten'
    assert chatbot.reading_time_s(text) == pytest.approx(10 / 300 * 60)
    assert chatbot.reading_time_s('') == 0.0
    assert chatbot.reading_time_s('  spaced\n\twords  ') == pytest.approx(2 / 300 * 60)


def test_a_gripper_rule_names_skills_that_take_things(tmp_path):
    """The gripper rule (issue 27) drives the plan grammar and the judge: each of its skills
    must exist with the arguments the rule reads."""
    data = yaml.safe_load((PROFILES_DIR / 'indy7.yaml').read_text(encoding='utf-8'))
    assert load_profile('indy7').gripper is not None
    data['gripper'] = {'take': 'grab'}
    with pytest.raises(ProfileError, match="no skill named 'grab'"):
        load_profile_file(_write(tmp_path, data, 'arm.yaml'))
    data['gripper'] = {'take': 'move_joint'}
    with pytest.raises(ProfileError, match=r'move_joint must take the string arguments'):
        load_profile_file(_write(tmp_path, data, 'arm.yaml'))
    assert load_profile('tello').gripper is None


def test_a_flight_rule_names_a_takeoff_a_landing_and_what_is_done_landed(tmp_path):
    data = yaml.safe_load((PROFILES_DIR / 'tello.yaml').read_text(encoding='utf-8'))
    flight = load_profile('tello').flight
    assert flight is not None and (flight.takeoff, flight.land) == ('takeoff', 'land')
    for rule, error in [({'land': 'descend'}, "no skill named 'descend'"),
                        ({'land': 'move_up'}, 'move_up must take no arguments'),
                        ({'on_ground': ['log', 'sing']}, "on_ground names no skill 'sing'"),
                        ({'on_ground': ['takeoff']}, "on_ground holds 'takeoff'")]:
        data['flight'] = rule
        with pytest.raises(ProfileError, match=error):
            load_profile_file(_write(tmp_path, data, 'drone.yaml'))
    arm = yaml.safe_load((PROFILES_DIR / 'indy7.yaml').read_text(encoding='utf-8'))
    arm['flight'] = {'takeoff': 'grip', 'land': 'release', 'on_ground': []}
    with pytest.raises(ProfileError, match='a gripper rule or a flight rule, not both'):
        load_profile_file(_write(tmp_path, arm, 'arm.yaml'))
    assert load_profile('indy7').flight is None
